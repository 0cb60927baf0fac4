"""Figures as PNG bytes for ``ipywidgets.Image``, and where output can go.

Widgets redraw into an ``Image`` rather than displaying figures: the value is
a widget trait, so it updates in place, works from a background thread and is
restored from the kernel when the page reloads.  Figures are bare
``matplotlib.figure.Figure`` objects on the Agg canvas: no pyplot state, no
inline-backend display, nothing to close.
"""

from __future__ import annotations

import io
import sys
import threading
from typing import Any

DPI = 72


def new_figure(figsize: tuple[float, float], nrows: int = 1, ncols: int = 1, **kw: Any):
    """(figure, axes) on a private Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **kw)


def png_bytes(fig) -> bytes:
    """The figure as PNG bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def message_png(text: str, figsize: tuple[float, float] = (6.0, 1.2)) -> bytes:
    """A small image that says why there is no plot."""
    fig, ax = new_figure(figsize)
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=9, transform=ax.transAxes)
    return png_bytes(fig)


def in_kernel() -> bool:
    """True inside a Jupyter kernel (where widget messages have somewhere to go)."""
    if "ipykernel" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def gib(nbytes: float | None) -> str:
    """Bytes as GiB, or MiB below 1 GiB (toy models on CPU)."""
    if nbytes is None:
        return "n/a"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
