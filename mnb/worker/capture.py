"""What a cell prints or shows on a rank, turned into protocol messages.

``sys.stdout``/``sys.stderr`` are replaced by :class:`RankStream`, which
hands each write, tagged with the running cell's id, to the channel's
outbox (consecutive writes travel as one ``stream`` message); the controller
assembles lines, labels them by rank and folds identical ones.

``display(obj)`` builds a MIME bundle from the object's ``_repr_*_`` methods
(the protocol IPython itself uses) without importing IPython, and sends it
as a ``display`` message.  Matplotlib figures left open by a cell are sent
as PNG after the cell, like the inline backend does, then closed.

A rank's background threads (Megatron-Core's import after the hello, the presets' compile) are not
the cell's: :func:`write_this_thread_to_log` sends what they print, warn or log to the pool's log,
as it went before the hello, whichever cell happens to be running.
"""

from __future__ import annotations

import io
import sys
import threading
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


_this_thread = threading.local()


def write_this_thread_to_log() -> None:
    """Send this thread's writes to ``sys.stdout``/``sys.stderr`` to the pool's log, not to a cell.

    For a rank's background work, whose output belongs to no cell: Megatron-Core's import after
    the hello (:class:`~mnb.worker.late_start.LateStart`) would otherwise print its notices into
    whichever cell waits for it.  ``%mnb start --verbose`` leaves them in the cells.
    """
    _this_thread.to_log = True


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
        if getattr(_this_thread, "to_log", False):
            return self._to_log(text)
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

    def _to_log(self, text: str) -> int:
        # looked up now: FdCapture.start moves sys.__stderr__/__stdout__ to the log's own descriptors
        log = sys.__stdout__ if self.name == "stdout" else sys.__stderr__
        try:
            log.write(text)
            log.flush()
        except (AttributeError, OSError, ValueError):  # no log (closed, or None): the rank is ending anyway
            pass
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


def plain_streams_after_fork() -> None:
    """A forked child (``multiprocessing``'s default on Linux, ``os.fork()``) writes ``sys.stdout``/``stderr``
    to fds 1 and 2, which :class:`FdCapture` carries to the running cell: its copy of :class:`RankStream`
    would queue every print for a channel whose I/O thread the fork did not copy (a user trial saw a
    child's ``print`` never arrive).  Registered once, where the rank takes over its streams."""
    import os

    def plain() -> None:
        for name, fd in (("stdout", 1), ("stderr", 2)):
            if isinstance(getattr(sys, name), RankStream):
                setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                                    errors="replace", line_buffering=True))

    os.register_at_fork(after_in_child=plain)


class FdCapture:
    """File-descriptor level capture: what child processes (``subprocess.run(["echo", ...])``,
    ``make``) and C code write to fds 1 and 2 reaches the running cell, and the pool log.

    Python-level prints go through :class:`RankStream`; a child process inherits the file
    descriptors, not ``sys.stdout``.  :meth:`start` points fds 1 and 2 at pipes; one thread per
    pipe copies every byte to the original descriptor (the pool log, as before) and, while a
    request runs (:attr:`cell_id`), hands the text to the channel as that cell's output, which
    the controller labels by rank.  The rank's own log lines (``logging``, warnings routed to
    the log, ``sys.__stderr__``) are moved to the original descriptors, so they stay out of
    the cells.  :meth:`drain` waits until what was written so far has been handed on (called
    before a request's reply, so a child's last line lands in its cell).
    """

    _MARK = b"\x00mnb-drain\x00"

    def __init__(self, channel: Any) -> None:
        self._channel = channel
        self.cell_id: str | None = None
        self._threads: list[Any] = []
        self._drained: dict[int, Any] = {}

    def start(self) -> None:
        import logging
        import os
        import threading

        for fd, name in ((1, "stdout"), (2, "stderr")):
            original = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            log_stream = open(os.dup(original), "w", buffering=1, encoding="utf-8", errors="replace",
                              closefd=True)
            old_stream = sys.__stdout__ if fd == 1 else sys.__stderr__
            for handler in logging.getLogger().handlers:
                if getattr(handler, "stream", None) is old_stream:
                    handler.setStream(log_stream)
            if fd == 1:
                sys.__stdout__ = log_stream  # type: ignore[misc]
            else:
                sys.__stderr__ = log_stream  # type: ignore[misc]
            self._drained[fd] = threading.Event()
            thread = threading.Thread(target=self._pump, args=(fd, name, read_end, original),
                                      name=f"mnb-fd{fd}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, fd: int, name: str, read_end: int, original: int) -> None:
        import codecs
        import os

        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pending = b""
        while True:
            try:
                data = os.read(read_end, 65536)
            except OSError:
                return
            if not data:
                return
            data = pending + data
            pending = b""
            marked = False
            if self._MARK in data:
                data = data.replace(self._MARK, b"")
                marked = True
            else:  # a marker cut by the read: keep its start for the next read
                for i in range(len(self._MARK) - 1, 0, -1):
                    if data.endswith(self._MARK[:i]):
                        data, pending = data[:-i], data[-i:]
                        break
            if data:
                with _suppress_os_errors():
                    os.write(original, data)
                cell = self.cell_id
                text = decoder.decode(data)
                if cell is not None and text:
                    self._channel.write_stream(name, text, cell)
            if marked:
                self._drained[fd].set()

    def drain(self, timeout_s: float = 5.0) -> None:
        """Hand on what fds 1 and 2 hold so far (a marker through each pipe, then wait for it)."""
        import os

        if not self._threads:
            return
        for fd, event in self._drained.items():
            event.clear()
            with _suppress_os_errors():
                os.write(fd, self._MARK)
        for event in self._drained.values():
            event.wait(timeout_s)


class _suppress_os_errors:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, value: Any, tb: Any) -> bool:
        return kind is not None and issubclass(kind, (OSError, ValueError))
