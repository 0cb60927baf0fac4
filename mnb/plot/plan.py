"""plot_plan: predicted memory vs predicted MFU for the rows of mnb.estimate.plan."""

from __future__ import annotations

import math
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
    nominal = any(math.isnan(r.mfu) for r in rows)  # a placeholder device (the CPU): no MFU to plot
    order = {id(r): i + 1 for i, r in enumerate(rows)}

    def y(r: PlanRow) -> float:
        return order[id(r)] if nominal else r.mfu * 100

    largest = max(r.memory_bytes for r in rows)
    unit, scale = next(((u, size) for u, size in (("GiB", GIB), ("MiB", MIB)) if largest >= size), ("KiB", KIB))
    fit = [r for r in rows if r.fits]
    nofit = [r for r in rows if not r.fits]
    if fit:
        ax.scatter([r.memory_bytes / scale for r in fit], [y(r) for r in fit],
                   color=COLORS["weights"], s=28, label=f"fits ({len(fit)})", zorder=3)
    if nofit:
        ax.scatter([r.memory_bytes / scale for r in nofit], [y(r) for r in nofit],
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
        if not any(r.parallel == o.parallel for o in labelled):
            labelled.append(r)
    if fit:
        best = fit[0]
        ax.scatter([best.memory_bytes / scale], [y(best)], marker="*", s=220,
                   color="#F0B400", edgecolor="black", zorder=4, label="best")
    ax.set_xlabel(f"predicted peak memory per rank ({unit})")
    if nominal:
        ax.set_ylabel("place in the plan (1 = first)")
        ax.invert_yaxis()
        ax.set_title(f"{len(rows)} layouts on CPU, each a prediction (no run): peak memory per rank; no MFU is "
                     "predicted for the nominal CPU", fontsize=9)
    else:
        ax.set_ylabel("predicted MFU (%)")
        ax.set_title(f"{len(rows)} layouts, each a prediction (no run): peak memory per rank vs MFU", fontsize=10)
    # beside the axes: inside, "best" would cover points or labels
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    points = [(r.memory_bytes / scale, y(r)) for r in rows]
    big = [(best.memory_bytes / scale, y(best))] if fit else []
    label_points(ax, [(r.describe(), (r.memory_bytes / scale, y(r))) for r in labelled], points, big)
    return ax


LABEL_DISTANCES_PT = (6, 10, 16, 24, 34, 46, 60, 76, 95, 120, 150, 185)
"""How far from its point (points, 1/72 in) a label may sit, nearest first."""
LABEL_ANGLES = tuple(range(0, 360, 15))


def label_points(ax, labels: Sequence[tuple[str, tuple[float, float]]], points: Sequence[tuple[float, float]],
                 big: Sequence[tuple[float, float]] = (), *, fontsize: float = 7) -> list:
    """Annotate each ``(text, (x, y))`` where its text covers no point of ``points`` (markers ``big`` larger)
    and no other label, inside the axes, its leader line crossing as few points as can be; nearest first.

    Placed on the drawn figure (its final layout and limits); the labels stay out of the layout.  Returns
    the annotations.
    """
    import numpy as np

    fig = ax.figure
    fig.draw_without_rendering()
    px_per_pt = fig.dpi / 72
    xy = ax.transData.transform(np.asarray(points, dtype=float).reshape(-1, 2))
    radius = np.full(len(xy), 4.0 * px_per_pt)  # s=28: a marker about 5 pt across, and a margin
    if len(big):
        xy = np.vstack([xy, ax.transData.transform(np.asarray(big, dtype=float).reshape(-1, 2))])
        radius = np.concatenate([radius, np.full(len(big), 9.0 * px_per_pt)])
    frame = ax.get_window_extent()
    taken: list[tuple[float, float, float, float]] = []
    out = []
    for text, at in labels:
        probe = ax.text(0, 0, text, fontsize=fontsize)
        extent = probe.get_window_extent()
        probe.remove()
        width, height = extent.width + 2 * px_per_pt, extent.height + 2 * px_per_pt
        own = ax.transData.transform([at])[0]
        choice = None
        for dist in LABEL_DISTANCES_PT:
            for angle in LABEL_ANGLES:
                dx, dy = dist * np.cos(np.radians(angle)), dist * np.sin(np.radians(angle))
                ax_, ay = own[0] + dx * px_per_pt, own[1] + dy * px_per_pt
                left = dx >= -1e-9
                box = (ax_ if left else ax_ - width, ay - height / 2, (ax_ + width) if left else ax_, ay + height / 2)
                if box[0] < frame.x0 or box[2] > frame.x1 or box[1] < frame.y0 or box[3] > frame.y1:
                    continue
                covered = _circles_in_box(xy, radius, box) + sum(_overlap(box, other) for other in taken)
                crossed = _circles_on_segment(xy, radius, own, (ax_, ay))
                score = (covered, crossed, dist)
                if choice is None or score < choice[0]:
                    choice = (score, dx, dy, left, box)
            if choice is not None and choice[0][:2] == (0, 0):
                break  # nothing covered, nothing crossed: the nearest such place
        if choice is None:  # no room inside the axes at all: beside the point
            choice = ((0, 0, 0), 6.0, 0.0, True, (own[0], own[1], own[0], own[1]))
        _, dx, dy, left, box = choice
        note = ax.annotate(text, at, xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                           ha="left" if left else "right", va="center",
                           arrowprops={"arrowstyle": "-", "color": "#888888", "linewidth": 0.5, "shrinkA": 0,
                                       "shrinkB": 3})
        note.set_in_layout(False)
        taken.append(box)
        out.append(note)
    return out


def _circles_in_box(xy, radius, box) -> int:
    """How many circles (centres ``xy``, ``radius``) reach into ``box`` (x0, y0, x1, y1), all in pixels."""
    import numpy as np

    nearest_x = np.clip(xy[:, 0], box[0], box[2])
    nearest_y = np.clip(xy[:, 1], box[1], box[3])
    return int(np.sum((xy[:, 0] - nearest_x) ** 2 + (xy[:, 1] - nearest_y) ** 2 < radius ** 2))


def _circles_on_segment(xy, radius, start, end) -> int:
    """How many circles the segment from ``start`` (a point's own centre, not counted) to ``end`` passes through."""
    import numpy as np

    start, end = np.asarray(start, dtype=float), np.asarray(end, dtype=float)
    d = end - start
    length2 = float(d @ d) or 1.0
    t = np.clip(((xy - start) @ d) / length2, 0.0, 1.0)
    dist2 = np.sum((start + t[:, None] * d - xy) ** 2, axis=1)
    own = np.sum((xy - start) ** 2, axis=1) < 1.0
    return int(np.sum((dist2 < radius ** 2) & ~own))


def _overlap(a, b) -> int:
    return int(a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3])
