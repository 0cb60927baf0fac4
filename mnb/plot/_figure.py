"""Figure creation shared by the plot functions.

Every ``plot_x(obj, ax=None) -> Axes`` draws into ``ax`` when given.  Without
one it makes a figure, and the choice matters for Jupyter:

- Inside an IPython kernel (``ipykernel`` loaded) the figure comes from
  ``matplotlib.pyplot``, so the inline backend displays it at the end of the
  cell and then closes it (no pile-up of open figures), exactly as for a
  figure the user made with ``plt.subplots()``.
- Anywhere else (scripts, tests, rank processes) it is a bare
  ``matplotlib.figure.Figure``: no pyplot global state, nothing to close;
  save it with ``ax.figure.savefig(path)``.

No function here calls ``plt.show()`` or changes rcParams or styles.
"""

from __future__ import annotations

from typing import Any

from mnb.units import in_kernel

COLORS = {
    "weights": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer": "#55A868",
    "activations": "#C44E52",
    "other": "#8172B3",
    "measured": "#333333",
    "forward": "#4C9BE8",
    "backward": "#E8A04C",
    "comm": "#B0B0B0",
    "idle": "#F2DEDE",
    "capacity": "#C00000",
}


def new_axes(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float] = (7.0, 4.0), **kw: Any):
    """(figure, axes) without touching pyplot unless a Jupyter kernel will display it."""
    if in_kernel():
        import matplotlib.pyplot as plt

        return plt.subplots(nrows, ncols, figsize=figsize, **kw)
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(nrows, ncols, **kw)
    return fig, axes
