"""Which parallel sizes a model and a world size allow, and why the others are refused.

The rules are not repeated here: every candidate is tried against
:meth:`mnb.config.ParallelConfig.resolve`, :meth:`mnb.config.ModelConfig.check_parallel`
and :meth:`mnb.config.TrainConfig.num_microbatches` (plus Megatron-Core's
interleaving rule ``num_microbatches >= pp``), and the message of the first
rule that fails is the reason shown to the user::

    >>> from mnb.config import load_preset, ParallelConfig
    >>> opts = axis_options("tp", load_preset("llama-8b"), ParallelConfig(), gpus=8)
    >>> opts.valid
    [1, 2, 4, 8]
    >>> opts.unavailable[3]
    'tp(3) * pp(1) * cp(1) = 3 does not divide world size 8; choose sizes whose product divides 8'

Pure Python: no widgets, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mnb.config import ModelConfig, ParallelConfig, TrainConfig, divisors

AXES = ("tp", "pp", "vpp", "cp", "ep")
"""The layout sizes the explorer offers, in Megatron's order."""

MAX_LISTED = 8
"""Every value up to this is a candidate; above it only divisors and powers of two."""


@dataclass(frozen=True)
class AxisOptions:
    """Valid values of one axis given the others, and a reason for each refused candidate."""

    axis: str
    valid: list[int]
    unavailable: dict[int, str] = field(default_factory=dict)


def candidates(axis: str, model: ModelConfig, gpus: int) -> list[int]:
    """Values worth offering for ``axis``: small numbers, divisors and powers of two."""
    if axis == "vpp":
        top = min(model.num_layers, MAX_LISTED)
        return list(range(1, top + 1))
    top = gpus if axis != "pp" else min(gpus, model.num_layers)
    if axis == "ep":
        top = min(top, model.num_moe_experts or 1) if model.is_moe else min(top, 2)
    values = set(range(1, min(top, MAX_LISTED) + 1)) | {d for d in divisors(gpus) if d <= top}
    values |= {2**k for k in range(0, 12) if 2**k <= top}
    return sorted(values)


def check_layout(
    model: ModelConfig,
    parallel: ParallelConfig,
    gpus: int,
    train: TrainConfig | None = None,
    *,
    batch: bool = True,
) -> ParallelConfig:
    """Resolve ``parallel`` on ``gpus`` and check it against the model (and ``train``, if given).

    With ``batch=False`` the global batch only counts for the interleaving rule
    (rounded up to whole microbatches), not for its own divisibility: the
    explorer rounds the batch after the layout changes.  Returns the resolved
    layout; raises ValueError with the numbers otherwise.
    """
    resolved = parallel.resolve(gpus)
    model.check_parallel(resolved)
    if resolved.sequence_parallel and resolved.tp == 1:
        raise ValueError("sequence parallel needs tp > 1 (it splits activations over the tp ranks)")
    if train is not None:
        dp = resolved.dp or 1
        if batch:
            m = train.num_microbatches(dp)
        else:
            per = train.micro_batch_size * dp
            m = -(-(train.global_batch_size or per) // per)
        if resolved.vpp > 1 and m < resolved.pp:
            raise ValueError(
                f"the interleaved schedule (vpp={resolved.vpp}) needs num_microbatches({m}) >= "
                f"pp({resolved.pp}); raise global_batch_size to at least "
                f"{resolved.pp * train.micro_batch_size * dp}"
            )
    return resolved


def axis_options(
    axis: str, model: ModelConfig, parallel: ParallelConfig, gpus: int, train: TrainConfig | None = None
) -> AxisOptions:
    """Try every candidate of ``axis`` with the other sizes of ``parallel`` held fixed."""
    if axis not in AXES:
        raise ValueError(f"axis must be one of {', '.join(AXES)}, got {axis!r}")
    valid: list[int] = []
    refused: dict[int, str] = {}
    for value in candidates(axis, model, gpus):
        try:
            trial = replace(parallel, dp=None, **{axis: value})
            if axis == "tp" and value == 1 and trial.sequence_parallel:
                trial = replace(trial, sequence_parallel=False)
            check_layout(model, trial, gpus, train if axis in ("vpp", "pp") else None, batch=False)
        except ValueError as err:
            refused[value] = str(err)
        else:
            valid.append(value)
    return AxisOptions(axis=axis, valid=valid, unavailable=refused)


def nearest(value: int, valid: list[int]) -> int:
    """The valid value closest to ``value`` (the smaller one on a tie)."""
    if not valid:
        raise ValueError("no valid value to choose from")
    return min(valid, key=lambda v: (abs(v - value), v))
