"""Figures as PNG bytes for ``ipywidgets.Image``.

Widgets redraw into an ``Image`` rather than displaying figures: the value is
a widget trait, so it updates in place, works from a background thread and is
restored from the kernel when the page reloads.  Figures are bare
``matplotlib.figure.Figure`` objects on the Agg canvas: no pyplot state, no
inline-backend display, nothing to close.  Byte units and the "in a kernel"
check are :mod:`mnb.units`' (both sides share them).
"""

from __future__ import annotations

import io
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


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
