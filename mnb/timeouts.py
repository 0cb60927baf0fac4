"""Named timeouts and intervals, one place for both sides (stdlib only; imported by the
controller, the magics and the ranks' worker).

Where two sides must agree, one is derived from the other: the controller declares a
silent rank on another host dead only after that rank would have given up on the
controller itself (``REMOTE_RANK_SILENCE_S`` > ``CONTROLLER_SILENCE_S``).
"""

from __future__ import annotations

# ---------------------------------------------------------------- start and stop
START_TIMEOUT_S = 180.0
"""How long ``%mnb start`` / ``Pool.start`` wait for every rank's hello (``--timeout``); also
how long an automatic restart may take to restore the layout."""
SHUTDOWN_WAIT_S = 3.0
"""How long ``stop()`` lets idle ranks leave on their own before they are signalled."""
STOP_REQUEST_WAIT_S = 10.0
"""How long ``stop()``/``restart()`` wait for a request another thread runs to end once cancelled
(it ends at its next check, within a tenth of a second, unless an event handler blocks it)."""
TEARDOWN_GRACE_S = 5.0
"""Between SIGTERM and SIGKILL when the pool's processes are ended."""
EXIT_TEARDOWN_GRACE_S = 2.0
"""The same when the kernel's interpreter exits (atexit): shorter, the user is leaving."""
DEATH_REPORT_WAIT_S = 3.0
"""How long to wait for torchrun to record how its ranks ended before the death is reported."""
FIRST_CONTACT_TIMEOUT_S = 600.0
"""A rank that never heard from the controller gives up after this long (a slow start of many ranks)."""

# ---------------------------------------------------------------- liveness
HEARTBEAT_INTERVAL_S = 1.0
"""Both sides send a heartbeat this often."""
CONTROLLER_SILENCE_S = 15.0
"""A rank ends itself after this long without hearing from the controller."""
REMOTE_RANK_SILENCE_S = CONTROLLER_SILENCE_S + 5 * HEARTBEAT_INTERVAL_S
"""A rank on another host counts as dead after this long without a heartbeat: by then a rank
that lost the controller has given up on its own (``CONTROLLER_SILENCE_S``)."""

# ---------------------------------------------------------------- one request
DEFAULT_GRACE_S = 3.0
"""After one rank fails, how long the others may take to finish the cell before they are stopped."""
ASK_TIMEOUT_S = 3.0
"""How long ``status`` and ``stacks`` wait for the ranks' I/O threads (answered while a cell runs)."""
INTERRUPT_ACK_S = 1.0
"""How long the ranks' I/O threads may take to acknowledge an ``interrupt``."""
RELEASE_S = 1.0
"""How long a rank may take to return after its interrupt before it counts as unreleased."""
INTERRUPT_NUDGE_S = (0.2, 0.5, 1.0, 2.0)
"""After an interrupt, when (seconds after it) a rank still running the cell, where the interrupt found it,
gets a no-op signal besides (``mnb.worker.channel.NUDGE_SIGNAL``): a SIGINT that lands after Python last
checked for signals but before the main thread blocks in a lock is only noted, and the thread sleeps on
(CPython's lost wake-up: a rank in ``Event.wait`` 'did not stop' and was restarted, CI leg 2 on 50ca0f1);
the nudge wakes the wait, which then runs the noted handler.  All but the last within ``RELEASE_S``."""
INTERRUPT_RELEASE_MAX_S = 60.0
"""At most this long for an interrupted cell's ranks to return (grace plus two step times)."""
DEFERRED_STOP_S = 300.0
"""How long an interrupted mnb.train may take to reach its step boundary (a second interrupt stops at once)."""
VALUES_TIMEOUT_S = 60.0
"""``push`` and ``pull``: pickling and sending values, no user code."""
