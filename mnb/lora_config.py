"""LoRA's settings (:class:`LoraConfig`) and the projection names it targets: one definition, read by
:func:`mnb.lora` on the ranks and by :func:`mnb.estimate.memory` in the notebook (re-exported by
:mod:`mnb.config`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

LORA_HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "c_attn", "c_proj", "c_fc")
"""Hugging Face projection names :func:`mnb.lora` adapts (Llama/Mistral/Qwen2/Mixtral attention and dense MLP;
GPT-2's Conv1D ``c_attn``, ``c_proj``, ``c_fc``), as peft's ``target_modules`` name them."""
LORA_MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron's names for the same projections (``linear_qkv`` = q, k and v; ``linear_fc1`` = gate and up)."""
LORA_ALL = "all-linear"
"""peft's name for every projection above."""


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"), peft's semantics.

    A projection ``W`` (``[out, in]``) becomes ``W x + (alpha / rank) * B A dropout(x)`` with ``A``
    ``[rank, in]`` (random, kaiming-uniform as peft) and ``B`` ``[out, rank]`` (zeros): a fresh adapter
    changes nothing.  Only ``A`` and ``B`` train.  Used by :func:`mnb.lora` on the ranks and by
    :func:`mnb.estimate.memory` (``lora=``) in the notebook.
    """

    rank: int = 8
    """``r``: the adapters' inner width."""
    alpha: float = 16
    """``lora_alpha``: the update is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """``lora_dropout`` on the adapter's input (training only)."""
    targets: tuple[str, ...] | None = None
    """Projection names (:data:`LORA_HF_TARGETS`, :data:`LORA_MEGATRON_TARGETS`, or ``"all-linear"``);
    None: peft's default for the architecture (``q_proj``, ``v_proj``; GPT-2's ``c_attn``)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.targets is not None:
            targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
            if not targets:
                raise ValueError("LoRA targets is empty: name projections, e.g. targets=('q_proj', 'v_proj')")
            known = set(LORA_HF_TARGETS) | set(LORA_MEGATRON_TARGETS) | {LORA_ALL}
            unknown = [t for t in targets if t not in known]
            if unknown:
                raise ValueError(f"unknown LoRA target {unknown[0]!r}: choose from {', '.join(LORA_HF_TARGETS)}, "
                                 f"Megatron's {', '.join(LORA_MEGATRON_TARGETS)}, or {LORA_ALL!r}")
            object.__setattr__(self, "targets", targets)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def resolved_targets(self, gpt2: bool) -> tuple[str, ...]:
        """The targets, with peft's default and ``"all-linear"`` spelled out for a GPT-2 or Llama-like model."""
        if self.targets is None:
            return ("c_attn",) if gpt2 else ("q_proj", "v_proj")
        if LORA_ALL in self.targets:
            return LORA_MEGATRON_TARGETS
        return self.targets


def lora_config(value: "LoraConfig | dict | None") -> "LoraConfig | None":
    """A LoraConfig from itself, a dict of its fields, or None."""
    if value is None or isinstance(value, LoraConfig):
        return value
    if isinstance(value, dict):
        names = {f.name for f in fields(LoraConfig)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown LoRA settings {unknown}; LoraConfig takes {sorted(names)}")
        return LoraConfig(**value)
    raise ValueError(f"lora must be a LoraConfig, a dict of its fields or None, got {type(value).__name__}")
