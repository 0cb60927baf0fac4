"""Enumerate parallel layouts for a model on N GPUs, predict memory and speed, rank them.

    >>> import mnb.estimate as est
    >>> rows = est.plan("llama-7b", gpus=8, gpu="h200", seq=4096, mbs=1, gbs=128)
    >>> rows[0].parallel.describe(), rows[0].recompute
    ('tp1 pp1 dp8', 'none')

Rules: tp divides heads and query groups and stays within a node; pp divides
the layers; tp*pp*cp divides the GPUs, cp a power of two that splits the sequence
into 2*cp chunks; sequence parallel is on when tp > 1;
the distributed optimizer is on when dp*cp > 1 (Megatron shards it over both); vpp in ``vpps`` where layers
split evenly and m a multiple of pp (:func:`mnb.config.interleave_problem`); ep (MoE) divides
the experts and dp*cp; recompute in ``recomputes``; Megatron-FSDP's levels in ``fsdps`` where dp*cp > 1 (with one rank
in the group they shard nothing; ``optim`` is left out by default: it keeps and moves
what the distributed optimizer does) and ParallelConfig accepts the layout (not with pp > 1: Megatron-FSDP's device mesh has no pipeline dimension).  Rows are sorted: fitting layouts first, then by predicted
step time, then by memory.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from mnb.config import (FSDP_STRATEGIES, ModelConfig, ParallelConfig, TrainConfig, as_vpp, batch_problem, divisors,
                        interleave_problem)
from mnb.units import Text, format_bytes, format_percent, format_seconds

from . import hardware
from ._inputs import as_model, as_train
from .memory import MemoryEstimate, memory
from .pipeline import bubble
from .timing import StepTimeEstimate, step_time


MAX_CP = 8
"""Largest context-parallel size the plan tries by default (long sequences need more: pass ``cps``)."""


@dataclass(frozen=True, kw_only=True)
class PlanRow:
    """One candidate layout with its predictions."""

    parallel: ParallelConfig
    recompute: str
    use_distributed_optimizer: bool
    num_microbatches: int
    memory_bytes: float
    """Predicted peak over all ranks."""
    capacity_bytes: int | None
    fits: bool
    step_time_s: float
    mfu: float
    tokens_per_s: float
    bubble: float
    memory_estimate: MemoryEstimate
    time_estimate: StepTimeEstimate
    hfu: float = 0.0
    """Hardware FLOPs utilisation (with recompute), beside ``mfu`` (model FLOPs)."""

    def describe(self) -> str:
        extra = [] if self.recompute == "none" else [f"recompute={self.recompute}"]
        if self.use_distributed_optimizer and not self.parallel.fsdp:
            extra.append("dist-opt")
        return " ".join([self.parallel.describe(), *extra])


class Plan(list):
    """A list of :class:`PlanRow`, best first, that renders as a table in Jupyter."""

    @property
    def best(self) -> PlanRow | None:
        return self[0] if self and self[0].fits else None

    def table(self, limit: int = 15) -> Text:
        return Text(format_plan(self[:limit]))

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in ("layout", "memory/rank", *_HEADER[2:]))
        body = []
        for r in self[:30]:
            style = "" if r.fits else ' style="color:#999"'
            body.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in _cells(r)) + "</tr>")
        note = f"<p><small>{_NOMINAL_NOTE}</small></p>" if any(math.isnan(r.step_time_s) for r in self[:30]) else ""
        return f"<table><tr>{head}</tr>{''.join(body)}</table>{note}"


_HEADER = ("layout", "mem/rank", "fits", "step", "MFU", "HFU", "tokens/s")
_NOMINAL_NOTE = ("CPU: the hardware table's CPU is a nominal 1 TFLOP/s, not a model of this machine: no step time, "
                 "MFU or tokens/s is predicted, and the rows are in the order that nominal model gives; %mnb plan "
                 "--calibrate measures the pool's own CPUs. mem/rank fits this machine's RAM shared by the ranks on it.")


def _cells(r: PlanRow) -> tuple[str, ...]:
    """One row's columns as text (the one rendering of a row, for the table and its HTML)."""
    speed = (("—",) * 4 if math.isnan(r.step_time_s) else
             (format_seconds(r.step_time_s), format_percent(r.mfu), format_percent(r.hfu), f"{r.tokens_per_s:,.0f}"))
    return (r.describe(), format_bytes(r.memory_bytes), "yes" if r.fits else "no", *speed)


def format_plan(rows: Iterable[PlanRow]) -> str:
    """Plain-text table of plan rows (layout, memory, fits, step time, MFU, HFU, tokens/s).

    Each memory and time carries its own unit (GiB..B, s..µs): a tiny model's plan read
    '0.0 GiB' and '0.000 s' in fixed columns.
    """
    rows = list(rows)
    cells = [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in [_HEADER, *cells]) for i in range(len(_HEADER))]  # long layouts stay aligned

    def line(values) -> str:
        return " ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    lines = [line(_HEADER), *(line(c) for c in cells)]
    if any(math.isnan(r.step_time_s) for r in rows):
        lines += textwrap.wrap(f"({_NOMINAL_NOTE})", 100)
    return "\n".join(lines)


def plan(
    model: str | ModelConfig | dict,
    gpus: int,
    gpu: str = "h200",
    seq: int | None = None,
    mbs: int = 1,
    gbs: int | None = None,
    *,
    train: TrainConfig | None = None,
    tps: Iterable[int] | None = None,
    pps: Iterable[int] | None = None,
    vpps: Sequence[int | None] = (1, 2),
    cps: Iterable[int] | None = None,
    eps: Iterable[int] | None = None,
    recomputes: Sequence[str] = ("none", "selective", "full"),
    fsdps: Sequence[str | None] = (None, "optim_grads", "optim_grads_params"),
    gpus_per_node: int = 8,
    capacity_bytes: int | None = None,
    achievable_fraction: float | None = None,
) -> Plan:
    """Enumerate valid layouts and rank them by predicted step time (fitting ones first).

    ``gbs`` defaults to ``train.global_batch_size`` or 4 * gpus * mbs;
    ``seq`` overrides ``model.seq_length``; ``train`` supplies precision and
    other settings (default: bf16).  ``capacity_bytes`` overrides the device's.
    ``cps`` defaults to 1 and the powers of two up to ``MAX_CP`` that divide the
    GPUs (context parallelism runs with or without Transformer Engine; its memory
    is that of mnb's all-gather attention, see :mod:`mnb.estimate.activations`).
    Step times come from :func:`mnb.estimate.step_time`'s shape-aware model
    (``gpu``'s calibration, :mod:`mnb.estimate.hardware`); ``achievable_fraction``
    switches to its first-order model.  ``fsdps``: the sharding levels tried (None: Megatron
    DDP with the distributed optimizer; see :mod:`mnb.estimate.sharding`).
    """
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
    if not isinstance(mbs, int) or mbs < 1:
        raise ValueError(f"mbs must be a positive integer, got {mbs!r}")
    model = as_model(model)
    if seq is not None:
        model = model.with_overrides(seq_length=seq)
    base = as_train(train) if train is not None else TrainConfig(bf16=True)
    gbs = gbs or base.global_batch_size or 4 * gpus * mbs
    if gbs % mbs:
        raise ValueError(f"gbs({gbs}) is not divisible by mbs({mbs})")
    node = min(gpus_per_node, gpus)
    capacity = capacity_bytes if capacity_bytes is not None else hardware.rank_capacity_bytes(hardware.device(gpu), node)
    tp_choices = list(tps) if tps is not None else [
        t for t in divisors(gpus) if t <= node and model.num_attention_heads % t == 0
        and model.query_groups % t == 0
    ]
    pp_choices = list(pps) if pps is not None else [p for p in divisors(gpus) if _splits(model, p)]
    cp_choices = list(cps) if cps is not None else [c for c in divisors(gpus) if c <= MAX_CP and c & (c - 1) == 0]
    vpp_choices = list(dict.fromkeys(as_vpp(v) for v in vpps))  # None (accepted) is 1: no interleaving
    fsdp_choices = list(dict.fromkeys(fsdps))
    for level in fsdp_choices:
        if level is not None and level not in FSDP_STRATEGIES:
            raise ValueError(f"fsdps: {level!r} is not a sharding level; choose from None, {', '.join(FSDP_STRATEGIES)}")
    ep_choices = list(eps) if eps is not None else (
        divisors(model.num_moe_experts) if model.is_moe else [1]
    )

    rows: list[PlanRow] = []
    for tp in tp_choices:
        for pp in pp_choices:
            for cp in cp_choices:
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                if batch_problem(gbs, mbs, dp):
                    continue
                m = gbs // (mbs * dp)
                for vpp in vpp_choices:
                    if vpp > 1 and (pp < 2 or interleave_problem(m, pp, vpp)):  # the layers' split: below
                        continue
                    for ep in ep_choices:
                        if (dp * cp) % ep:
                            continue
                        for fsdp in fsdp_choices if dp * cp > 1 else [None]:
                            try:  # ParallelConfig refuses the combinations mnb's --fsdp refuses
                                parallel = ParallelConfig(
                                    tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, dp=dp, sequence_parallel=tp > 1,
                                    fsdp=fsdp,
                                )
                                model.check_parallel(parallel)
                            except ValueError:
                                continue
                            for recompute in recomputes:
                                t = replace(
                                    base, micro_batch_size=mbs, global_batch_size=gbs,
                                    recompute=recompute, use_distributed_optimizer=dp * cp > 1,
                                )
                                rows.append(_row(model, parallel, t, gpu, capacity, gpus_per_node,
                                                 achievable_fraction))
    if not rows:
        raise ValueError(
            f"no valid layout for {model.name} on {gpus} GPUs with gbs({gbs}), mbs({mbs}): "
            f"layers {model.num_layers}, heads {model.num_attention_heads}, "
            f"query groups {model.query_groups}; try another gbs or GPU count"
        )
    # on a nominal device (the CPU) the nominal step time still orders the rows (recompute, communication),
    # though it is not shown
    rows.sort(key=lambda r: (not r.fits, r.time_estimate.total_s, r.memory_bytes))
    return Plan(rows)


def _splits(model: ModelConfig, pp: int) -> bool:
    """The model's layers go onto pp stages (evenly, or as its first/last counts or layout say)."""
    try:
        model.layers_per_stage(pp)
    except ValueError:
        return False
    return True


def _row(model, parallel, train, gpu, capacity, gpus_per_node, achievable_fraction) -> PlanRow:
    mem = memory(model, parallel, train, gpu=gpu)
    mem = replace(mem, capacity_bytes=capacity)
    t = step_time(
        model, parallel, train, gpu=gpu, gpus_per_node=gpus_per_node,
        achievable_fraction=achievable_fraction,
    )
    fits = capacity is None or mem.peak_bytes <= capacity
    step, mfu, hfu, tokens = t.total_s, t.mfu, t.hfu, t.tokens_per_s
    if hardware.device(gpu).nominal:  # a placeholder peak: no time, MFU or tokens/s to claim
        step = mfu = hfu = tokens = float("nan")
    return PlanRow(
        parallel=parallel,
        recompute=train.recompute,
        use_distributed_optimizer=train.use_distributed_optimizer,
        num_microbatches=mem.num_microbatches,
        memory_bytes=mem.peak_bytes,
        capacity_bytes=capacity,
        fits=fits,
        step_time_s=step,
        mfu=mfu,
        hfu=hfu,
        tokens_per_s=tokens,
        bubble=bubble(parallel, mem.num_microbatches),
        memory_estimate=mem,
        time_estimate=t,
    )
