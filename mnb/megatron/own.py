"""``mnb.train`` with your own Megatron model and step (not built by ``mnb.gpt``).

Your module is held in a :class:`~mnb.megatron.model.MegatronModel` (kept on the
module, so a second ``mnb.train`` continues with the same DDP wrapper and
optimizer), described for FLOPs and estimates by its ``TransformerConfig``
(:func:`mnb.megatron.record.describe_model`); your ``forward_step_func`` and
``data_iterator`` go to Megatron's schedule unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mnb.megatron import layout as _layout
from mnb.megatron.model import MegatronModel

_HELD = "_mnb_model"


@dataclass
class OwnStep:
    model: MegatronModel
    forward_step_func: Any
    data_iterator: Any

    @classmethod
    def of(cls, module: Any, forward_step_func, data_iterator, seq_length: int | None) -> "OwnStep":
        """Check what ``mnb.train`` was given and hold ``module`` for it (errors say what to pass)."""
        if forward_step_func is None:
            raise TypeError(
                f"mnb.train got a {type(module).__name__}, not a model from mnb.gpt(): pass your "
                "forward_step_func=(data_iterator, model) -> (output, loss_func) and data_iterator= too")
        if not callable(forward_step_func):
            raise TypeError(f"forward_step_func must be callable, got {type(forward_step_func).__name__}")
        if isinstance(module, MegatronModel):
            return cls(module, forward_step_func, data_iterator)
        chunks = list(module) if isinstance(module, (list, tuple)) else [module]
        for chunk in chunks:
            if not isinstance(chunk, torch.nn.Module) or not hasattr(getattr(chunk, "config", None), "num_layers"):
                raise TypeError(
                    f"mnb.train needs a Megatron module (a MegatronModule whose .config is a TransformerConfig, "
                    f"e.g. GPTModel), or a list of them for vpp; got {type(chunk).__name__}")
        held = getattr(chunks[0], _HELD, None)
        if held is None:
            held = _hold(chunks, seq_length)
            object.__setattr__(chunks[0], _HELD, held)  # not a submodule or parameter: plain attribute
        elif seq_length is not None and seq_length != held.config.seq_length:
            held.config = held.config.with_overrides(seq_length=seq_length)
        return cls(held, forward_step_func, data_iterator)


def _hold(chunks: list, seq_length: int | None) -> MegatronModel:
    from mnb.megatron.record import describe_model

    parallel = _layout.require_layout()
    tconfig = chunks[0].config
    lm_seq = next((int(m.max_sequence_length) for c in chunks for m in c.modules()
                   if getattr(m, "max_sequence_length", None)), None)
    seq = seq_length or lm_seq
    if not seq:
        raise TypeError("mnb.train cannot tell this model's sequence length: pass seq_length=")
    model_config, vocab = describe_model(tconfig, chunks, seq)
    return MegatronModel(chunks=chunks, config=model_config, transformer_config=tconfig, parallel=parallel,
                         padded_vocab_size=vocab, seed=0, layout_generation=_layout.generation(),
                         user_model=True)
