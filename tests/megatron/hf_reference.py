"""transformers as the reference the Hugging Face tests compare mnb with (one definition for test_hf and test_lora)."""

from __future__ import annotations


def reference_logits(folder, tokens):
    """transformers' fp32 logits of ``tokens`` ([batch, tokens] ids) for the checkpoint in ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()
