"""plot_timeline (measured Gantt per pipeline stage) and plot_schedule (predicted).

Boxes: forward and backward microbatches (number inside, one shade per
virtual chunk); communication and optimizer intervals as thin grey bars;
the forward-backward span shaded behind, so idle time shows as the pale
background.  The title names the step drawn and its idle share (of the step's
pipeline span, mean over stages), then the run's measured bubble as ``Run.summary``
states it (its statistic named) beside the predicted (p-1)/(m+p-1) or
(p-1)/(v*m+p-1) (Narayanan et al. 2021).  Microbatch numbers are written
into the boxes while they fit; with many microbatches only every k-th is
labelled, so the picture stays legible at any m.
"""

from __future__ import annotations

from typing import Any

from mnb.config import ParallelConfig
from mnb.estimate import bubble, simulate_schedule, timeline_bubble

from ._coerce import as_run, step_span
from ._figure import COLORS, new_axes

COMPUTE = ("forward", "backward")
LABEL_GAP = 1 / 30
"""Microbatch numbers on one stage are at least this share of the time axis apart (no overlaps)."""


def _draw(ax, events: list[dict[str, Any]], pp: int, unit: str, scale: float) -> None:
    compute = [e for e in events if e.get("kind") in COMPUTE]
    if not events:
        ax.text(0.5, 0.5, "no timeline recorded", ha="center", va="center", transform=ax.transAxes)
        return
    t0 = min(float(e["start_s"]) for e in (compute or events))
    if compute:
        span_end = max(float(e["end_s"]) for e in compute)
        for stage in range(pp):
            ax.barh(stage, (span_end - t0) * scale, left=0.0, height=0.9, color=COLORS["idle"],
                    edgecolor="none", zorder=0)
    chunks = max((int(e.get("chunk") or 0) for e in events), default=0) + 1
    axis_span = max((float(e["end_s"]) for e in events), default=t0) - t0
    last_label = {}  # stage -> x of its last number
    for e in sorted(events, key=lambda e: float(e["start_s"])):
        start = (float(e["start_s"]) - t0) * scale
        width = (float(e["end_s"]) - float(e["start_s"])) * scale
        stage = int(e.get("stage", 0))
        kind = e.get("kind")
        if kind in COMPUTE:
            chunk = int(e.get("chunk") or 0)
            alpha = 1.0 - 0.45 * chunk / max(chunks - 1, 1) if chunks > 1 else 1.0
            ax.barh(stage, width, left=start, height=0.8, color=COLORS[kind], alpha=alpha,
                    edgecolor="white", linewidth=0.5, zorder=2)
            mb, middle = e.get("microbatch"), start + width / 2
            if mb is not None and middle - last_label.get(stage, -1e30) >= LABEL_GAP * axis_span * scale:
                ax.text(middle, stage, str(mb), ha="center", va="center", fontsize=7, zorder=3)
                last_label[stage] = middle
        else:  # a strip on top: communication inside a forward (MoE dispatch) must stay visible
            ax.barh(stage + 0.3, width, left=start, height=0.15, color=COLORS["comm"],
                    edgecolor="none", zorder=4)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"stage {s}" for s in range(pp)])
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    from matplotlib.patches import Patch

    handles = [Patch(color=COLORS["forward"], label="forward"),
               Patch(color=COLORS["backward"], label="backward"),
               Patch(color=COLORS["idle"], label="idle")]
    if any(e.get("kind") not in COMPUTE for e in events):
        handles.append(Patch(color=COLORS["comm"], label="comm / optimizer"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_timeline(run: Any, ax=None, step: int | None = None):
    """Gantt chart of one measured step of a Run, per pipeline stage.

    ``step`` is a recorded step number (``run.steps``; default: the last).  The title says
    which step is drawn, by the number the summary and the repr give it (the model's, from 1),
    with that step's idle share; below it the run's measured bubble exactly as
    ``run.summary()`` states it (the same number and statistic, e.g. the median of steps
    after the first) beside the theoretical one.
    """
    run = as_run(run, ("timeline", "num_microbatches", "theoretical_bubble", "measured_bubble",
                       "measured_bubble_statistic", "steps"))
    events = run.timeline(step)
    if ax is None:
        _, ax = new_axes(figsize=(9.0, 1.4 + 0.6 * run.layout.pp))
    span = max((float(e["end_s"]) for e in events), default=0) - min(
        (float(e["start_s"]) for e in events), default=0)
    unit, scale = ("ms", 1e3) if span < 10 else ("s", 1.0)
    _draw(ax, events, run.layout.pp, unit, scale)
    ax.set_title(timeline_title(run, events), fontsize=10)
    return ax


def timeline_title(run: Any, events: list[dict[str, Any]]) -> str:
    """Two lines: the drawn step and its own idle share; the run's bubble as the summary says it."""
    drawn = timeline_bubble(events)
    shown = events[0].get("step") if events else None
    if shown is None:
        first = "no step recorded"
    else:
        numbers = run.steps or run.timeline_steps()
        first = (f"step {int(shown)} of {len(numbers)} drawn" if numbers[:1] == [1]
                 else f"step {int(shown)} (of {step_span(numbers)}) drawn")
        if drawn is not None:
            first += f": idle {drawn['bubble']:.1%} of this step's pipeline span"
    second = ""
    if run.measured_bubble is not None:
        second = f"run's bubble {run.measured_bubble:.1%} ({run.measured_bubble_statistic}) vs "
    second += f"theoretical {run.theoretical_bubble:.1%} ({run.layout.describe()}, m={run.num_microbatches})"
    return f"{first}\n{second}"


def plot_schedule(
    parallel: ParallelConfig,
    num_microbatches: int,
    ax=None,
    *,
    forward_s: float = 1.0,
    backward_s: float = 2.0,
):
    """Schematic predicted timeline of one step from (pp, vpp, m) alone.

    Simulated with :func:`mnb.estimate.simulate_schedule` (backward twice a
    forward by default, transfers free): its bubble equals the formula.
    """
    events = simulate_schedule(parallel, num_microbatches, forward_s=forward_s, backward_s=backward_s)
    if ax is None:
        _, ax = new_axes(figsize=(9.0, 1.0 + 0.6 * parallel.pp))
    _draw(ax, events, parallel.pp, "forward passes of one stage", 1.0 / forward_s)
    sim = timeline_bubble(events)
    ax.set_title(
        f"predicted {'interleaved' if parallel.vpp > 1 else '1F1B'} pp={parallel.pp}"
        + (f" vpp={parallel.vpp}" if parallel.vpp > 1 else "")
        + f" m={num_microbatches}: bubble {sim['bubble']:.1%} "
        f"(formula {bubble(parallel, num_microbatches):.1%})",
        fontsize=10,
    )
    return ax
