"""FP8 linears on the local spec (mnb.megatron.fp8): the refusals, the Function's arithmetic against
an fp32 emulation of torch._scaled_mm, and training under tp/sp on CPU ranks (torch's CPU _scaled_mm)."""

from __future__ import annotations

import pytest


def fp8_training(recipe: str, tp: int, sp: bool) -> dict:
    """bf16 then FP8 training of the same model and data on these ranks; losses and the recipe installed."""
    from mnb.config import ParallelConfig
    from mnb.megatron import fp8
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt
    from mnb.megatron.train import train

    fp8.RUN_ON_CPU = True
    apply_layout(ParallelConfig(tp=tp, sequence_parallel=sp))
    out = {}
    for name, value in (("bf16", None), (recipe, recipe)):
        model = gpt("tiny", fp8=value, fusions=False, ffn_hidden_size=256)
        record = train(model, steps=3, micro_batch_size=2, global_batch_size=2, bf16=True, lr=1e-3)
        out[name] = [row["loss"] for row in record["steps"]]
        out[f"{name}_installed"] = fp8.installed(model.chunks)
        out[f"{name}_grad_norms"] = [row["grad_norm"] for row in record["steps"]]
    return out
