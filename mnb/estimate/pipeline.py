"""Pipeline schedules: bubble fraction, microbatches in flight, a schedule simulator
and the bubble measured from a timeline.

The bubble, one definition everywhere in mnb: **the fraction of a step's
pipeline span that a stage sits idle** — per stage, idle time inside the
step's compute span (first forward start to last backward end, over all
stages) divided by that span; the pipeline's value is the mean over stages.
It always lies in [0, 1] and falls as microbatches grow.

Its prediction follows Narayanan et al. 2021 ("Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473, sec. 2.2):
1F1B with p stages and m microbatches idles (p-1) forward+backward slots per
stage, a bubble time of (p-1)/m of the ideal compute time (their ratio), so
the idle fraction of the span is (p-1)/(m+p-1); the interleaved schedule with
v chunks per rank divides the bubble time by v: (p-1)/(v*m+p-1).

Usage::

    >>> from mnb.config import ParallelConfig
    >>> from mnb.estimate import bubble, bubble_time_ratio
    >>> round(bubble(ParallelConfig(pp=4, dp=1), num_microbatches=8), 4)   # 3 / 11
    0.2727
    >>> bubble_time_ratio(ParallelConfig(pp=4, dp=1), num_microbatches=8)  # (p-1)/m
    0.375
"""

from __future__ import annotations

from typing import Any, Sequence, Iterable

from mnb.config import ParallelConfig, as_vpp, interleave_problem

COMPUTE_KINDS = ("forward", "backward")


def bubble(parallel: ParallelConfig, num_microbatches: int) -> float:
    """Predicted bubble: the idle fraction of a step's pipeline span, in [0, 1].

    ``(pp-1)/(m+pp-1)`` for 1F1B, ``(pp-1)/(vpp*m+pp-1)`` for the interleaved
    schedule (Narayanan et al. 2021, sec. 2.2.1 and 2.2.2, expressed as a share
    of the step instead of a ratio to compute).  0 when pp == 1.
    """
    ratio = bubble_time_ratio(parallel, num_microbatches)
    return ratio / (1 + ratio)


def bubble_time_ratio(parallel: ParallelConfig, num_microbatches: int) -> float:
    """Bubble time over ideal compute time, Narayanan et al.'s ``(pp-1)/(vpp*m)`` (can exceed 1).

    A step takes ``compute * (1 + ratio)``; :func:`bubble` is ``ratio / (1 + ratio)``.
    """
    m = num_microbatches
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {m!r}")
    return (parallel.pp - 1) / (parallel.vpp * m)


def warmup_microbatches(pp: int, stage: int, num_microbatches: int, vpp: int | None = 1) -> int:
    """Forward passes a stage runs before its first backward (Megatron-Core schedules.py).

    1F1B: ``pp - stage - 1``; interleaved: ``(pp - stage - 1) * 2 + (vpp - 1) * pp``
    (microbatch group size = pp, the default); both capped at the total number
    of (chunk, microbatch) forward passes.  ``vpp`` 1 (or None) is plain 1F1B.
    """
    v = as_vpp(vpp)
    total = num_microbatches * v
    if pp == 1:
        return 0
    if v == 1:
        warm = pp - stage - 1
    else:
        warm = (pp - stage - 1) * 2 + (v - 1) * pp
    return min(warm, total)


def in_flight(pp: int, stage: int, num_microbatches: int, vpp: int | None = 1) -> int:
    """(chunk, microbatch) activations a stage holds at its peak.

    1F1B: ``min(pp - stage, m)`` microbatches (stage r stashes its warm-up
    forwards plus the one in steady state).  Interleaved: warm-up + 1 chunk
    passes; for stage 0 this equals Megatron's memory factor
    ``1 + (pp-1)/(pp*vpp)`` times pp microbatches of the stage's layers.
    """
    v = as_vpp(vpp)
    return min(warmup_microbatches(pp, stage, num_microbatches, v) + 1, num_microbatches * v)


def _chunk_order(pp: int, m: int, v: int) -> list[tuple[int, int]]:
    """(chunk, microbatch) forward order on every rank, groups of pp microbatches."""
    order: list[tuple[int, int]] = []
    for start in range(0, m, pp):
        for chunk in range(v):
            for mb in range(start, min(start + pp, m)):
                order.append((chunk, mb))
    return order


def simulate_schedule(
    parallel: ParallelConfig,
    num_microbatches: int,
    *,
    forward_s: float | Sequence[float] = 1.0,
    backward_s: float | Sequence[float] = 2.0,
    step: int = 0,
) -> list[dict[str, Any]]:
    """Predicted timeline of one step: events shaped like measured timeline entries.

    ``forward_s``/``backward_s`` are the times of one microbatch through one
    stage's full set of layers (one number for equal stages, or one per stage,
    e.g. measured ones); with vpp each chunk takes 1/vpp of that.  Each
    stage runs Megatron's op order (warm-up forwards, 1F1B steady state,
    cool-down backwards); an op starts when its stage is free and its input
    (previous stage's forward, next stage's backward) has arrived.  Transfers
    take no time, so the idle time is the schedule's own bubble.
    """
    pp, m, v = parallel.pp, num_microbatches, parallel.vpp
    if m < 1:
        raise ValueError(f"num_microbatches must be positive, got {m}")
    problem = interleave_problem(m, pp, v)
    if problem:
        raise ValueError(problem)
    fwd_order = _chunk_order(pp, m, v)
    bwd_order = [(v - 1 - c, mb) for c, mb in fwd_order]
    tf = [t / v for t in _per_stage(forward_s, pp, "forward_s")]
    tb = [t / v for t in _per_stage(backward_s, pp, "backward_s")]
    ops: list[list[tuple[str, int, int]]] = []
    for stage in range(pp):
        warm = warmup_microbatches(pp, stage, m, parallel.vpp) if pp > 1 else 0
        seq: list[tuple[str, int, int]] = []
        f = b = 0
        total = m * v
        for _ in range(warm):
            seq.append(("forward", *fwd_order[f]))
            f += 1
        while f < total:
            seq.append(("forward", *fwd_order[f]))
            f += 1
            seq.append(("backward", *bwd_order[b]))
            b += 1
        while b < total:
            seq.append(("backward", *bwd_order[b]))
            b += 1
        ops.append(seq)

    done: dict[tuple[str, int, int, int], float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    events: list[dict[str, Any]] = []
    remaining = sum(len(s) for s in ops)
    while remaining:
        progressed = False
        for stage in range(pp):
            while pos[stage] < len(ops[stage]):
                kind, chunk, mb = ops[stage][pos[stage]]
                dep = _dependency(kind, stage, chunk, mb, pp, v)
                if dep is not None and dep not in done:
                    break
                start = max(free[stage], done[dep] if dep is not None else 0.0)
                end = start + (tf[stage] if kind == "forward" else tb[stage])
                done[(kind, stage, chunk, mb)] = end
                free[stage] = end
                events.append(
                    {"step": step, "stage": stage, "chunk": chunk, "kind": kind,
                     "microbatch": mb, "start_s": start, "end_s": end}
                )
                pos[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - guards a schedule bug, not user input
            raise RuntimeError("pipeline schedule simulation deadlocked")
    return events


def _per_stage(value: float | Sequence[float], pp: int, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * pp
    values = [float(x) for x in value]
    if len(values) != pp:
        raise ValueError(f"{name} has {len(values)} values for pp({pp}) stages")
    return values


def _dependency(kind: str, stage: int, chunk: int, mb: int, pp: int, v: int):
    if kind == "forward":
        if stage > 0:
            return ("forward", stage - 1, chunk, mb)
        if chunk > 0:
            return ("forward", pp - 1, chunk - 1, mb)
        return None
    if stage < pp - 1:
        return ("backward", stage + 1, chunk, mb)
    if chunk < v - 1:
        return ("backward", 0, chunk + 1, mb)
    return ("forward", stage, chunk, mb)


def timeline_bubble(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """Bubble measured from the timeline events of one step (see the module doc).

    The span runs from the first compute start to the last compute end over
    all stages (times must share one clock: :meth:`mnb.analysis.runs.Run.timeline`
    aligns ranks).  Per stage, idle = span - busy, busy the union of its
    forward/backward intervals; the stage's bubble is idle / span and the
    pipeline's is their mean, comparable with :func:`bubble`.  Returns
    ``{"bubble", "by_stage": {stage: bubble}, "span_s", "busy_s": {stage: s}}``
    or None without compute events.
    """
    by_stage: dict[int, list[tuple[float, float]]] = {}
    for ev in events:
        if ev.get("kind") not in COMPUTE_KINDS:
            continue
        by_stage.setdefault(int(ev.get("stage", 0)), []).append(
            (float(ev["start_s"]), float(ev["end_s"]))
        )
    if not by_stage:
        return None
    start = min(s for iv in by_stage.values() for s, _ in iv)
    end = max(e for iv in by_stage.values() for _, e in iv)
    span = end - start
    busy = {stage: _union_length(intervals) for stage, intervals in sorted(by_stage.items())}
    stage_bubble = {stage: (max(span - b, 0.0) / span if span > 0 else 0.0) for stage, b in busy.items()}
    return {
        "bubble": sum(stage_bubble.values()) / len(stage_bubble),
        "by_stage": stage_bubble,
        "span_s": span,
        "busy_s": busy,
    }


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total = 0.0
    cur_s = cur_e = None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
