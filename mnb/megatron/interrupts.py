"""Interrupts that stop a training run at the same step boundary on every rank.

Kernel -> Interrupt reaches each rank as a SIGINT at a slightly different
moment.  Raised where it lands, it would leave one rank inside a collective
the others already left (a hang), or one data-parallel replica with a step
the others never applied (silently different weights).  Inside
:func:`deferred`, SIGINT only sets a flag; the training loop adds the flag to
the all-reduce it already makes for the step's loss, so every rank learns
"someone was interrupted" at the same step and they all stop after it::

    with interrupts.deferred() as flag:
        for step in ...:
            ...                       # a whole step, never cut in half
            stop = all_reduce_with(loss, flag.requested)
            if stop:
                break

Outside the main thread (nothing can signal there) the flag simply stays down.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from typing import Iterator


@dataclass
class InterruptFlag:
    requested: bool = False


_depth = 0  # > 0 while the main thread is inside deferred()


def is_deferring() -> bool:
    """Whether an interrupt now would be held until a step boundary (asked from the rank's I/O thread)."""
    return _depth > 0


@contextlib.contextmanager
def deferred() -> Iterator[InterruptFlag]:
    """Within the block SIGINT sets ``flag.requested`` instead of raising KeyboardInterrupt."""
    flag = InterruptFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def note(signum: int, frame: object) -> None:
        flag.requested = True

    global _depth
    previous = signal.signal(signal.SIGINT, note)
    _depth += 1
    try:
        yield flag
    finally:
        _depth -= 1
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
