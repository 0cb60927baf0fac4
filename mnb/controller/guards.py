"""How a request stays whole: stopped by an interrupt (or a stop) only where that is safe.

The interrupt latch and the section that holds interrupts live on the notebook side and
never touch a rank; the request gate that uses them (one request at a time) is ``gate.py``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator


class InterruptLatch:
    """Jupyter's interrupt, counted instead of raised while a request runs.

    Kernel -> Interrupt is a SIGINT, which Python turns into KeyboardInterrupt
    at whatever bytecode runs next: inside a half-updated rank table, a socket
    send, a ``thread.join``.  While a request is in flight the latch counts
    interrupts instead, and the code that waits (the collector, the wait for a
    restart) asks :meth:`take` at points where stopping is safe.  Only the main
    thread receives signals, so elsewhere the latch never counts anything.
    """

    def __init__(self) -> None:
        self.count = 0
        self.taken = 0
        self.cancelled: str | None = None
        """Why another thread ended this request (``Pool.stop``/``restart``): the waits end at once."""
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> "InterruptLatch":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._arrived)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None
                          else signal.default_int_handler)
            self._installed = False

    def _arrived(self, signum: int, frame: Any) -> None:
        self.count += 1

    def cancel(self, reason: str) -> None:
        """End the request's waits from another thread; ``reason`` is the error its caller gets."""
        self.cancelled = reason

    def take(self) -> bool:
        """Whether an interrupt arrived since the last ``take`` (and mark it handled)."""
        if self.count > self.taken:
            self.taken = self.count
            return True
        return False


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Jupyter's interrupt over a short section that takes a lock, then deliver it.

    CPython may raise KeyboardInterrupt between acquiring a lock in ``with lock:``
    and entering its body, or between the body and the release; a lock the I/O
    thread also takes would then stay held for good.  An interrupt arriving in the
    section goes, at its end, to the handler that was in place (the request's
    :class:`InterruptLatch` counts it, Python's default raises KeyboardInterrupt).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if arrived and callable(previous):
            previous(signal.SIGINT, None)


NO_LATCH = InterruptLatch()
"""For waits outside a request (``status``, a start): never interrupted, never cancelled."""
