"""What a cell prints or shows on a rank, turned into protocol messages.

``sys.stdout``/``sys.stderr`` are replaced by :class:`RankStream`, which
hands each write, tagged with the running cell's id, to the channel's
outbox (consecutive writes travel as one ``stream`` message); the controller
assembles lines, labels them by rank and folds identical ones.

``display(obj)`` builds a MIME bundle from the object's ``_repr_*_`` methods
(the protocol IPython itself uses) without importing IPython, and sends it
as a ``display`` message.  Matplotlib figures left open by a cell are sent
as PNG after the cell, like the inline backend does, then closed.
"""

from __future__ import annotations

import io
import sys
from typing import Any, Callable

from mnb.protocol import Message

Send = Callable[[Message], None]

_REPR_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
)


class RankStream(io.TextIOBase):
    """A text stream whose writes become ``stream`` messages for the current cell."""

    def __init__(self, name: str, send: Send | Any, rank: int, fallback: Any):
        """``send``: the rank's :class:`~mnb.worker.channel.Channel` (whose ``write_stream``
        batches text), or any callable taking a ``stream`` :class:`Message` per write."""
        self.name = name
        self._write_stream = getattr(send, "write_stream", None)
        self._send = send
        self._rank = rank
        self._fallback = fallback
        self.cell_id: str | None = None

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not text:
            return 0
        if self._write_stream is not None:
            self._write_stream(self.name, text, self.cell_id)
        else:
            self._send(
                Message(
                    "stream",
                    header={"rank": self._rank, "name": self.name, "text": text, "cell": self.cell_id},
                )
            )
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        # Libraries that ask for a file descriptor (faulthandler, subprocess)
        # get the real one, whose output lands in the pool's log file.
        return self._fallback.fileno()


def mime_bundle(obj: Any) -> dict[str, Any]:
    """The MIME bundle of ``obj``; text/plain always present."""
    if _is_matplotlib_figure(obj):
        return {"image/png": figure_png(obj), "text/plain": repr(obj)}
    bundle: dict[str, Any] = {}
    method = getattr(obj, "_repr_mimebundle_", None)
    if callable(method):
        try:
            data = method()
        except TypeError:
            data = method(include=None, exclude=None)
        if isinstance(data, tuple):
            data = data[0]
        bundle.update(data or {})
    for mime, name in _REPR_METHODS:
        if mime in bundle:
            continue
        method = getattr(obj, name, None)
        if callable(method):
            value = method()
            if isinstance(value, tuple):
                value = value[0]
            if value is not None:
                bundle[mime] = value
    bundle.setdefault("text/plain", repr(obj))
    if isinstance(bundle.get("image/png"), bytes):
        import base64

        bundle["image/png"] = base64.b64encode(bundle["image/png"]).decode()
    return bundle


def figure_png(figure: Any) -> str:
    import base64

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def _is_matplotlib_figure(obj: Any) -> bool:
    mpl_figure = sys.modules.get("matplotlib.figure")
    return mpl_figure is not None and isinstance(obj, mpl_figure.Figure)


def open_figures() -> list[Any]:
    """Figures a cell left open in pyplot (only if the cell imported pyplot)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return []
    return [pyplot.figure(num) for num in pyplot.get_fignums()]


def close_figures() -> None:
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close("all")
