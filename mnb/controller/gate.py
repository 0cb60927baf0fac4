"""The request gate: one request at a time, and the only way another thread ends one.

Replies are read from one queue, so a second thread (the explorer's background
"Run on pool", a sweep, ``mnb.train`` in a thread) must not wait on it
concurrently: a request from another thread while one runs is refused at once,
never queued behind a long training run.  ``status`` and ``stacks`` do not take
the gate.  Each request runs under its own :class:`~mnb.controller.guards.InterruptLatch`
(Jupyter's interrupt, taken where the request can stop cleanly).

``Pool.stop``/``restart`` call :meth:`RequestGate.taken_over`: requests starting
from then on are refused, the running one's latch is cancelled (its collector or
its wait for a restart returns at once with the reason), and the gate is held once
that request ended, so nothing reads the transport while the pool is torn down.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Any, Callable, Iterator

from mnb.controller.guards import NO_LATCH, InterruptLatch
from mnb.errors import PoolError, interrupted

log = logging.getLogger(__name__)


class RequestGate:
    """The lock requests take, who holds it, and each running request's interrupt latch."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.holder = ""
        """``"run in bg"``: the method and thread of the request that holds the gate (for refusals)."""
        self._latches: dict[int, InterruptLatch] = {}  # thread id -> the latch of its request
        self._closing: str | None = None

    def latch(self) -> InterruptLatch:
        """This thread's request's latch (:data:`NO_LATCH` outside a request)."""
        return self._latches.get(threading.get_ident(), NO_LATCH)

    def run(self, name: str, call: Callable[[], Any]) -> Any:
        """Run ``call`` as the request ``name``, or refuse at once while another thread holds the gate."""
        if not self._lock.acquire(blocking=False):
            raise PoolError(
                f"the pool is busy with a request from another thread ({self.holder}); "
                "wait for it to finish (a background 'Run on pool' or a sweep), then run this again"
            )
        previous, self.holder = self.holder, f"{name} in {threading.current_thread().name}"
        thread = threading.get_ident()
        outermost = thread not in self._latches
        try:
            if self._closing is not None and outermost:
                raise PoolError(f"{self._closing}; this request was not started")
            if not outermost:  # a request made by a request (same thread): the outer latch holds
                return call()
            with InterruptLatch() as latch:
                self._latches[thread] = latch
                result = call()
            if latch.take():
                raise interrupted("interrupted as the ranks finished the request; nothing was stopped")
            return result
        finally:
            if outermost:
                self._latches.pop(thread, None)
            self.holder = previous
            self._lock.release()

    @contextlib.contextmanager
    def taken_over(self, name: str, reason: str, wait_s: float) -> Iterator[bool]:
        """Refuse new requests, cancel another thread's running one, and hold the gate once it ended.

        Waits at most ``wait_s`` for that request to end (yields False, and logs, if it did
        not: the caller goes on without the gate).  The holder's own thread is never waited for.
        """
        self._closing = reason
        me = threading.get_ident()
        for thread, latch in list(self._latches.items()):
            if thread != me:
                latch.cancel(reason)
        deadline = time.monotonic() + wait_s
        got = False
        try:
            while not got and time.monotonic() < deadline:  # short waits: Jupyter's interrupt is not held off
                got = self._lock.acquire(timeout=0.1)
            if not got:
                log.warning("the request %s did not end within %.0f s of %s; going on without it",
                            self.holder, wait_s, name)
            previous = self.holder
            if got:
                self.holder = f"{name} in {threading.current_thread().name}"
            try:
                yield got
            finally:
                if got:
                    self.holder = previous
        finally:
            self._closing = None
            if got:
                self._lock.release()


def exclusive(method: Callable) -> Callable:
    """A method that is one request (:class:`~mnb.controller.requests.Requests`'): it runs through ``self._gate``.

    An interrupt nothing took while it ran (it arrived as the ranks finished) is
    raised when it returns, so Run All still stops.
    """

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._gate.run(method.__name__, lambda: method(self, *args, **kwargs))

    return guarded
