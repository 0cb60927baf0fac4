"""Hugging Face checkpoint folders for notebook-side tests: ``config.json`` (+ a ``tokenizer.json``), no weights.

The configs are those of real checkpoints (Llama-3.2-1B, Qwen2.5-0.5B, GPT-2 124M), written as
JSON so no test here imports transformers or torch. The tokenizer.json is a small stand-in: the
notebook side only checks that it exists and counts its ids.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIGS = {
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "bos_token_id": 128000, "eos_token_id": 128001, "initializer_range": 0.02, "torch_dtype": "bfloat16",
    },
    "Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "hidden_act": "silu", "tie_word_embeddings": True, "sliding_window": 32768, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151643, "initializer_range": 0.02, "torch_dtype": "bfloat16",
    },
    "gpt2": {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12,
        "n_positions": 1024, "vocab_size": 50257, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05,
        "bos_token_id": 50256, "eos_token_id": 50256, "initializer_range": 0.02,
    },
}


def checkpoint(root: Path, name: str, *, tokenizer_ids: int | None = None) -> Path:
    """``root/name`` holding the config of :data:`CONFIGS` ``[name]``, and a tokenizer.json of
    ``tokenizer_ids`` ids when given (a checkpoint without one otherwise)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIGS[name], indent=1))
    if tokenizer_ids is not None:
        vocab = {f"t{i}": i for i in range(tokenizer_ids - 1)}
        tokenizer = {"version": "1.0", "model": {"type": "BPE", "vocab": vocab, "merges": []},
                     "added_tokens": [{"id": tokenizer_ids - 1, "content": "<|end|>", "special": True}]}
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder
