"""Hugging Face checkpoints in and out of any layout: ``mnb.from_hf``, ``mnb.save_hf``.

Rank side.  One module per architecture family's name mapping (:mod:`.llama` for
Llama/Mistral/Qwen2, :mod:`.mixtral` for its experts, :mod:`.gpt2`), the generic slicing
rules they use (:mod:`.rules`), the safetensors headers and byte ranges (:mod:`.reader`),
the one-pass reads of a rank's slices (:mod:`.stream`), the loader (:mod:`.load`), the
saver (:mod:`.save`) and peft's LoRA folders (:mod:`.adapters`).  The notebook-side half,
``config.json`` -> :class:`mnb.config.ModelConfig`, is :mod:`mnb.hf_config`.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["from_hf", "save_hf", "save_adapter", "load_adapter"]

_LAZY = {"from_hf": ("mnb.megatron.hf.load", "from_hf"), "save_hf": ("mnb.megatron.hf.save", "save_hf"),
         "save_adapter": ("mnb.megatron.hf.adapters", "save_adapter"),
         "load_adapter": ("mnb.megatron.hf.adapters", "load_adapter")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'mnb.megatron.hf' has no attribute {name!r}")
