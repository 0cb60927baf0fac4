"""Argument normalisation shared by the estimators (presets, dicts, dp resolution)."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from mnb.config import ModelConfig, ParallelConfig, TrainConfig
from mnb.model_source import resolve_model

DEFAULT_VOCAB_DIVISOR = 128
"""Megatron-LM's --make-vocab-size-divisible-by default (the vocabulary is padded to a
multiple of this times tp)."""


def as_model(model: str | ModelConfig | dict) -> ModelConfig:
    """A ModelConfig from a preset name, a Hugging Face checkpoint folder (its config.json), a field
    dict or a ModelConfig (:func:`mnb.model_source.resolve_model`)."""
    return resolve_model(model)


def as_train(train: TrainConfig | dict | None) -> TrainConfig:
    if train is None:
        return TrainConfig()
    if isinstance(train, TrainConfig):
        return train
    if isinstance(train, dict):
        known = {f.name for f in fields(TrainConfig)}
        return TrainConfig(**{k: v for k, v in train.items() if k in known})
    raise TypeError(f"expected a TrainConfig or dict, got {type(train).__name__}")


def as_parallel(parallel: ParallelConfig | dict | None, gpus: int | None = None) -> ParallelConfig:
    """A ParallelConfig with dp filled in; ``gpus`` (the world size) resolves dp, else dp = 1."""
    if parallel is None:
        parallel = ParallelConfig()
    elif isinstance(parallel, dict):
        known = {f.name for f in fields(ParallelConfig)}
        parallel = ParallelConfig(**{k: v for k, v in parallel.items() if k in known})
    elif not isinstance(parallel, ParallelConfig):
        raise TypeError(f"expected a ParallelConfig or dict, got {type(parallel).__name__}")
    if gpus is not None:
        return parallel.resolve(gpus)
    if parallel.dp is None:
        # No world size given: the fewest replicas the layout allows (dp = 1 unless
        # expert parallelism needs ep to divide dp * cp).
        dp = parallel.ep // math.gcd(parallel.ep, parallel.cp)
        return parallel.resolve(dp * parallel.model_parallel_size)
    return parallel.resolve(parallel.dp * parallel.model_parallel_size)


def padded_vocab_size(model: ModelConfig, tp: int = 1) -> int:
    """Vocabulary padded as Megatron-LM pads it: to a multiple of divisor * tp.

    The divisor is ``model.extra['make_vocab_size_divisible_by']`` (default 128).
    """
    divisor = int(model.extra.get("make_vocab_size_divisible_by", DEFAULT_VOCAB_DIVISOR)) * tp
    return int(math.ceil(model.vocab_size / divisor) * divisor)


DEFAULT_DROPOUT = 0.0
"""mnb's rank-side default for hidden_dropout and attention_dropout (mnb.megatron.model
sets 0.0; Megatron-Core's own TransformerConfig default would be 0.1)."""


def dropout(model: ModelConfig, name: str) -> float:
    """Dropout probability from ``model.extra``, else mnb's default (0.0)."""
    value: Any = model.extra.get(name, DEFAULT_DROPOUT)
    return float(value)


def num_microbatches(train: TrainConfig, parallel: ParallelConfig, given: int | None) -> int:
    if given is not None:
        if not isinstance(given, int) or given < 1:
            raise ValueError(f"num_microbatches must be a positive integer, got {given!r}")
        return given
    return train.num_microbatches(parallel.dp or 1)
