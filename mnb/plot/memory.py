"""plot_memory: predicted memory components per rank beside the measured peak."""

from __future__ import annotations

from typing import Any

from mnb.estimate import COMPONENTS, MemoryEstimate

from ._coerce import as_run_or_estimate
from ._figure import COLORS, new_axes

GIB = 2**30
MAX_RANKS = 16
"""Above this many ranks, one rank per pipeline stage is shown (the one with the highest peak)."""


def plot_memory(obj: Any, ax=None):
    """Stacked predicted components (weights, gradients, optimizer, activations,
    other) per rank, the measured peak as a dark bar beside each, and the
    device capacity as a dashed line.

    ``obj``: a :class:`mnb.runs.Run` (or its records), or a
    :class:`~mnb.estimate.MemoryEstimate` alone (prediction only, one bar per
    pipeline stage).  Returns the Axes.
    """
    run, estimate = as_run_or_estimate(obj)
    if ax is None:
        _, ax = new_axes(figsize=(7.5, 4.0))
    if run is None:
        labels = [f"stage {s.stage}" for s in estimate.stages]
        predicted = [s.components() for s in estimate.stages]
        measured: list[float | None] = [None] * len(labels)
        capacity = estimate.capacity_bytes
        title = f"{estimate.model} | {estimate.parallel.describe()}: predicted per rank"
    else:
        estimate = run.predicted_memory
        peaks = run.peak_memory_bytes
        ranks = sorted(run.ranks)
        if len(ranks) > MAX_RANKS:
            best: dict[int, int] = {}
            for r in ranks:
                st = run.stage_of_rank(r)
                if st not in best or peaks.get(r, 0) > peaks.get(best[st], 0):
                    best[st] = r
            ranks = [best[s] for s in sorted(best)]
        labels = [f"rank {r}\nstage {run.stage_of_rank(r)}" for r in ranks]
        predicted = [estimate.stages[run.stage_of_rank(r)].components() for r in ranks]
        measured = [peaks.get(r) for r in ranks]
        capacity = run.capacity_bytes or estimate.capacity_bytes
        title = f"{run.model.name} | {run.layout.describe()}: predicted vs measured ({run.memory_source})"

    has_measured = any(m is not None for m in measured)
    width = 0.38 if has_measured else 0.6
    offset = width / 2 if has_measured else 0.0
    xs = list(range(len(labels)))
    bottoms = [0.0] * len(xs)
    for name in COMPONENTS:
        heights = [p[name] / GIB for p in predicted]
        ax.bar([x - offset for x in xs], heights, width, bottom=bottoms, color=COLORS[name],
               label=f"predicted {name}")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if has_measured:
        ax.bar([x + offset for x in xs], [(m or 0) / GIB for m in measured], width,
               color=COLORS["measured"], label="measured peak")
    if capacity:
        ax.axhline(capacity / GIB, color=COLORS["capacity"], linestyle="--", linewidth=1.2,
                   label=f"capacity {capacity / GIB:.0f} GiB")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("memory per rank (GiB)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax
