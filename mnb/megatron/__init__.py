"""Rank-side Megatron-Core layer of mnb.

Runs inside the torchrun ranks (never in the notebook kernel):

- :mod:`mnb.megatron.cpu`     redirect Megatron's hard-coded CUDA calls on CPU ranks
- :mod:`mnb.megatron.layout`  (re)initialise tp/pp/vpp/cp/ep process groups in live ranks
- :mod:`mnb.megatron.spec`    layer specs: Transformer Engine when present, else a fast local spec
- :mod:`mnb.megatron.model`   ``gpt()``: this rank's part of a GPT for the current layout
- :mod:`mnb.megatron.train`   ``train()``: Megatron schedules, DDP, optimizer, run records
- :mod:`mnb.megatron.hf`      ``from_hf()`` / ``save_hf()``: Hugging Face checkpoints into any layout and back
- :mod:`mnb.megatron.logits`  ``logits()``: fp32 logits of any model, the same on every rank
- :mod:`mnb.megatron.timing`  per-microbatch timeline recorder (``config.timers``)
- :mod:`mnb.megatron.memory`  per-step memory readings
- :mod:`mnb.megatron.events`  the channel through which records and progress leave the rank

Submodules import torch and Megatron; this package file imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["apply_layout", "current_layout", "coordinates", "gpt", "train", "install_cpu"]

_LAZY = {
    "apply_layout": ("mnb.megatron.layout", "apply_layout"),
    "current_layout": ("mnb.megatron.layout", "current_layout"),
    "coordinates": ("mnb.megatron.layout", "coordinates"),
    "gpt": ("mnb.megatron.model", "gpt"),
    "train": ("mnb.megatron.train", "train"),
    "install_cpu": ("mnb.megatron.cpu", "install"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'mnb.megatron' has no attribute {name!r}")
