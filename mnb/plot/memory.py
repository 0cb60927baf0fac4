"""plot_memory: predicted beside measured memory, per component and per rank."""

from __future__ import annotations

from typing import Any

from mnb.estimate import COMPONENTS
from mnb.units import GIB, MIB

from ._coerce import as_run_or_estimate
from ._figure import COLORS, new_axes

MAX_RANKS = 8
"""Above this many ranks, one rank per pipeline stage is shown (the one with the highest peak)."""
SIDE_BY_SIDE = ("weights", "gradients", "optimizer", "activations", "peak")
MEMORY_FIELDS = ("measured_memory", "predicted_components", "predicted_memory", "peak_memory_bytes",
                 "records_by_rank", "stage_of_rank", "capacity_bytes", "memory_source")
"""What plot_memory reads of a run (besides ``layout`` and ``model``)."""


def plot_memory(obj: Any, ax=None):
    """Predicted and measured memory side by side, per component, for each rank.

    With a run whose ranks counted their tensors (``run.measured_memory``): for
    each rank shown, a pale bar (predicted) and a dark bar (measured) per
    component — weights, gradients, optimizer, activations (the logits
    included: what the loss saves for backward is measured there too) and the
    peak — so a small component is compared at its own size, not hidden under
    a process's memory.  GiB or MiB, whichever suits the peak; the device
    capacity as a dashed line when known.

    A :class:`~mnb.estimate.MemoryEstimate` alone: the predicted components
    stacked, one bar per pipeline stage.  Returns the Axes.
    """
    run, estimate = as_run_or_estimate(obj, MEMORY_FIELDS)
    if run is None or not run.measured_memory:
        return _stacked(run, estimate, ax)
    measured = run.measured_memory
    ranks = _ranks_to_show(run, sorted(measured))
    predicted = {r: run.predicted_components(r) for r in ranks}
    largest = max(max(p["peak"], measured[r]["peak"]) for r, p in predicted.items())
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", MIB)
    if ax is None:
        _, ax = new_axes(figsize=(min(4.0 + 2.2 * len(ranks), 14.0), 4.2))
    group = len(SIDE_BY_SIDE) + 1  # one blank slot between ranks
    width = 0.4
    ticks, labels = [], []
    for i, rank in enumerate(ranks):
        for j, name in enumerate(SIDE_BY_SIDE):
            x = i * group + j
            color = COLORS["measured"] if name == "peak" else COLORS[name]
            ax.bar(x - width / 2, predicted[rank][name] / scale, width, color=color, alpha=0.35,
                   edgecolor=color, label="predicted" if (i, j) == (0, 0) else None)
            ax.bar(x + width / 2, measured[rank][name] / scale, width, color=color,
                   label="measured" if (i, j) == (0, 0) else None)
            ticks.append(x)
            labels.append(name if name != "activations" else "activ.")
        ax.text(i * group + (len(SIDE_BY_SIDE) - 1) / 2, -0.16, f"rank {rank} (stage {run.stage_of_rank(rank)})",
                ha="center", va="top", fontsize=8, transform=ax.get_xaxis_transform())
    capacity = run.capacity_bytes
    if capacity and capacity / scale < 3 * largest / scale:
        ax.axhline(capacity / scale, color=COLORS["capacity"], linestyle="--", linewidth=1.2,
                   label=f"capacity {capacity / GIB:.0f} GiB")
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=7, rotation=30)
    ax.set_ylabel(f"memory per rank ({unit})")
    peak_what = "allocator peak" if run.memory_source == "cuda" else "counted tensors"
    ax.set_title(f"{run.model.name} | {run.layout.describe()}: peak over {len(run.steps)} steps per rank, "
                 f"predicted (pale) vs measured ({peak_what})", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def _ranks_to_show(run: Any, ranks: list[int]) -> list[int]:
    if len(ranks) <= MAX_RANKS:
        return ranks
    peaks = run.peak_memory_bytes
    best: dict[int, int] = {}
    for r in ranks:
        stage = run.stage_of_rank(r)
        if stage not in best or peaks.get(r, 0) > peaks.get(best[stage], 0):
            best[stage] = r
    return [best[s] for s in sorted(best)][:MAX_RANKS]


def _stacked(run: Any, estimate: Any, ax):
    """Predicted components stacked per stage (estimate) or rank (a run without counts), peak beside."""
    if run is None:
        labels = [f"stage {s.stage}" for s in estimate.stages]
        predicted = [s.components() for s in estimate.stages]
        measured: list[float | None] = [None] * len(labels)
        capacity = estimate.capacity_bytes
        title = f"{estimate.model} | {estimate.parallel.describe()}: predicted per rank"
    else:
        estimate = run.predicted_memory
        peaks = run.peak_memory_bytes
        ranks = _ranks_to_show(run, sorted(run.records_by_rank))
        labels = [f"rank {r}\nstage {run.stage_of_rank(r)}" for r in ranks]
        predicted = [estimate.stages[run.stage_of_rank(r)].components() for r in ranks]
        measured = [peaks.get(r) for r in ranks]
        capacity = run.capacity_bytes or estimate.capacity_bytes
        title = (f"{run.model.name} | {run.layout.describe()}: peak over {len(run.steps)} steps, "
                 f"predicted vs measured ({run.memory_source})")
    if ax is None:
        _, ax = new_axes(figsize=(7.5, 4.0))
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
