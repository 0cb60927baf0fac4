"""plot_plan: predicted memory vs predicted MFU for the rows of mnb.estimate.plan."""

from __future__ import annotations

from typing import Sequence

from mnb.estimate import PlanRow
from mnb.units import GIB, KIB, MIB, format_bytes

from ._figure import COLORS, new_axes


def plot_plan(rows: Sequence[PlanRow], ax=None, *, label_top: int = 5):
    """Scatter of layouts: x = predicted peak memory per rank, y = predicted MFU.

    Fitting layouts are filled circles, the others grey crosses; the capacity
    is a dashed vertical line; the best ``label_top`` fitting rows are
    labelled and the best one starred.  Memory is in GiB, MiB or KiB, whichever the largest row
    needs (a tiny model's layouts all sat at 0.0 GiB); a capacity over 10x the largest row is
    named in the legend, not drawn (it would squeeze every point onto the axis).  Returns the Axes.
    """
    rows = list(rows)
    if ax is None:
        _, ax = new_axes(figsize=(7.5, 4.5))
    if not rows:
        ax.text(0.5, 0.5, "no layouts", ha="center", va="center", transform=ax.transAxes)
        return ax
    largest = max(r.memory_bytes for r in rows)
    unit, scale = next(((u, size) for u, size in (("GiB", GIB), ("MiB", MIB)) if largest >= size), ("KiB", KIB))
    fit = [r for r in rows if r.fits]
    nofit = [r for r in rows if not r.fits]
    if fit:
        ax.scatter([r.memory_bytes / scale for r in fit], [r.mfu * 100 for r in fit],
                   color=COLORS["weights"], s=28, label=f"fits ({len(fit)})", zorder=3)
    if nofit:
        ax.scatter([r.memory_bytes / scale for r in nofit], [r.mfu * 100 for r in nofit],
                   color="#999999", marker="x", s=24, label=f"does not fit ({len(nofit)})", zorder=2)
    capacity = next((r.capacity_bytes for r in rows if r.capacity_bytes), None)
    if capacity and capacity <= 10 * largest:
        ax.axvline(capacity / scale, color=COLORS["capacity"], linestyle="--", linewidth=1.2,
                   label=f"capacity {format_bytes(capacity)}")
    elif capacity:
        ax.plot([], [], " ", label=f"capacity {format_bytes(capacity)} (off the axis)")
    labelled: list[PlanRow] = []
    for r in fit:  # one label per layout (recompute variants sit on top of each other)
        if len(labelled) >= label_top:
            break
        if any(r.parallel == o.parallel for o in labelled):
            continue
        ax.annotate(r.describe(), (r.memory_bytes / scale, r.mfu * 100), fontsize=7,
                    xytext=(6, -10 * len(labelled)), textcoords="offset points",
                    arrowprops={"arrowstyle": "-", "color": "#888888", "linewidth": 0.5})
        labelled.append(r)
    if fit:
        best = fit[0]
        ax.scatter([best.memory_bytes / scale], [best.mfu * 100], marker="*", s=220,
                   color="#F0B400", edgecolor="black", zorder=4, label="best")
    ax.set_xlabel(f"predicted peak memory per rank ({unit})")
    ax.set_ylabel("predicted MFU (%)")
    ax.set_title(f"{len(rows)} layouts, each a prediction (no run): peak memory per rank vs MFU", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    return ax
