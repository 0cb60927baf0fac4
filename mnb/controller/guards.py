"""How a request stays whole: one at a time, and stopped by an interrupt only where that is safe.

Both guards live on the notebook side and never touch a rank.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from typing import Any, Callable, Iterator

from mnb.errors import PoolError, interrupted


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
"""For requests made outside :func:`exclusive` (a background restart): never interrupted."""


def exclusive(method: Callable) -> Callable:
    """One request at a time, and interrupts taken only where the request can stop cleanly.

    Replies are read from one queue, so a second thread (the explorer's
    background "Run on pool", a sweep) must not wait on it concurrently.  A
    request from another thread while one runs is refused at once, never
    queued behind a long training run.  ``status`` and ``stacks`` are not
    exclusive.  The request runs under an :class:`InterruptLatch` (found by
    ``self._latch()``); an interrupt nothing took while it ran (it arrived as
    the ranks finished) is raised when it returns, so Run All still stops.
    """

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._lock.acquire(blocking=False):
            raise PoolError(
                f"the pool is busy with a request from another thread ({self._lock_holder}); "
                "wait for it to finish (a background 'Run on pool' or a sweep), then run this again"
            )
        previous, self._lock_holder = self._lock_holder, f"{method.__name__} in {threading.current_thread().name}"
        thread = threading.get_ident()
        outermost = thread not in self._latches
        try:
            if not outermost:  # a request made by a request (same thread): the outer latch holds
                return method(self, *args, **kwargs)
            with InterruptLatch() as latch:
                self._latches[thread] = latch
                result = method(self, *args, **kwargs)
            if latch.take():
                raise interrupted("interrupted as the ranks finished the request; nothing was stopped")
            return result
        finally:
            if outermost:
                self._latches.pop(thread, None)
            self._lock_holder = previous
            self._lock.release()

    return guarded
