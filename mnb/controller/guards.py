"""How a request stays whole: one at a time, and every rank gets it or none.

Both guards live on the notebook side and never touch a rank.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from typing import Any, Callable, Iterator

from mnb.errors import PoolError


def exclusive(method: Callable) -> Callable:
    """One request at a time: replies are read from one queue, so a second thread
    (the explorer's background "Run on pool", a sweep) must not wait on it concurrently.
    A request from another thread while one runs is refused at once, never queued
    behind a long training run.  ``status`` and ``stacks`` are not exclusive."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._lock.acquire(blocking=False):
            raise PoolError(
                f"the pool is busy with a request from another thread ({self._lock_holder}); "
                "wait for it to finish (a background 'Run on pool' or a sweep), then run this again"
            )
        previous, self._lock_holder = self._lock_holder, f"{method.__name__} in {threading.current_thread().name}"
        try:
            return method(self, *args, **kwargs)
        finally:
            self._lock_holder = previous
            self._lock.release()

    return guarded


@contextlib.contextmanager
def sigint_deferred() -> Iterator[Callable[[], bool]]:
    """Hold Jupyter's interrupt while a request is sent, so every rank gets it or none.

    Yields a function telling whether an interrupt arrived meanwhile; the caller
    then treats it as an interrupt of the request just sent.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    arrived: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield lambda: bool(arrived)
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
