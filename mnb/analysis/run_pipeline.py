"""A run's pipeline, measured: the stages' timeline of one step and the bubble it shows beside the schedule's.

Apart from :mod:`mnb.analysis.runs` (a run's records and the rest of their analysis),
whose :class:`~mnb.analysis.runs.Run`
exposes these as ``run.timeline(step)``, ``run.measured_bubble``, ``run.expected_bubble``,
``run.theoretical_bubble``: what the ranks' timeline rows say about the pipeline is one concern.
Each function takes a ``Run`` (not imported here: runs imports this module); the schedule's own numbers
come from :mod:`mnb.estimate` (``bubble``, ``simulate_schedule``, ``timeline_bubble``).  Pure Python.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from mnb import estimate


def timeline(run: Any, step: int | None = None) -> list[dict[str, Any]]:
    """Timeline events of one step (default: the last), one rank per pipeline stage.

    Times are seconds from the earliest stage's start of that step, on the
    host clock the ranks share (``origin_s`` of each row), so one stage's
    idle time is measured against the others' work.
    """
    chosen: dict[int, int] = {}
    for rank, rec in run.records_by_rank.items():
        if rec.get("timeline"):
            stage = int((rec.get("coords") or {}).get("pp", rec["timeline"][0].get("stage", 0)))
            chosen.setdefault(stage, rank)
    steps = timeline_steps(run)
    if not chosen or not steps:
        return []
    wanted = steps[-1] if step is None else step
    events = []
    for stage, rank in chosen.items():
        for ev in run.records_by_rank[rank]["timeline"]:
            if int(ev.get("step", 0)) == wanted:
                events.append(dict(ev, stage=ev.get("stage", stage)))
    origin = min((float(ev["origin_s"]) for ev in events if "origin_s" in ev), default=None)
    if origin is not None:
        for ev in events:
            shift = float(ev.get("origin_s", origin)) - origin
            ev["start_s"], ev["end_s"] = float(ev["start_s"]) + shift, float(ev["end_s"]) + shift
    return events


def timeline_steps(run: Any) -> list[int]:
    steps = {int(ev.get("step", 0)) for rec in run.records for ev in rec.get("timeline") or []}
    return sorted(steps)


def measured_bubble_per_step(run: Any) -> dict[int, float]:
    """Bubble per step (the idle share of the step's pipeline span, mean over stages)."""
    out = {}
    for step in timeline_steps(run):
        result = estimate.timeline_bubble(timeline(run, step))
        if result is not None:
            out[step] = result["bubble"]
    return out


def measured_bubble_by_stage(run: Any) -> dict[int, float]:
    """Each stage's bubble: the median over steps after the first."""
    per: dict[int, list[float]] = {}
    for step in run.steady_steps(timeline_steps(run)):
        result = estimate.timeline_bubble(timeline(run, step))
        for stage, value in (result or {}).get("by_stage", {}).items():
            per.setdefault(stage, []).append(value)
    return {stage: median(values) for stage, values in sorted(per.items())}


def measured_bubble(run: Any) -> float | None:
    """The pipeline's bubble: median over steps after the first (robust on a loaded machine), in [0, 1]."""
    per = measured_bubble_per_step(run)
    values = [per[s] for s in run.steady_steps(list(per))]
    return median(values) if values else None


def expected_bubble(run: Any) -> float | None:
    """The schedule's bubble for the *measured* per-stage forward/backward times.

    (p-1)/(m+p-1) assumes equal stages; real stages differ (the first holds the
    embedding, the last the output layer and loss), and the faster stage waits
    for the slower one.  This replays Megatron's 1F1B order with each stage's
    mean measured microbatch times (``estimate.simulate_schedule``), so
    measured minus expected is what communication and host overhead cost.
    """
    steps = timeline_steps(run)
    if run.layout.pp < 2 or not steps:
        return None
    use = run.steady_steps(steps)
    durations: dict[tuple[int, str], list[float]] = {}
    for step in use:
        for ev in timeline(run, step):
            if ev["kind"] in ("forward", "backward"):
                durations.setdefault((int(ev["stage"]), ev["kind"]), []).append(ev["end_s"] - ev["start_s"])
    vpp = run.layout.vpp
    try:
        per_stage = {kind: [vpp * sum(durations[(s, kind)]) / len(durations[(s, kind)])
                            for s in range(run.layout.pp)] for kind in ("forward", "backward")}
    except KeyError:
        return None
    events = estimate.simulate_schedule(run.layout, run.num_microbatches,
                                        forward_s=per_stage["forward"], backward_s=per_stage["backward"])
    result = estimate.timeline_bubble(events)
    return None if result is None else result["bubble"]


def theoretical_bubble(run: Any) -> float:
    """The schedule's bubble for equal stages (:func:`mnb.estimate.bubble`: (p-1)/(m+p-1) for 1F1B)."""
    return estimate.bubble(run.layout, run.num_microbatches)
