"""A tiny channel from Megatron-side code to whoever runs it (the worker).

Dependency inversion: ``mnb.megatron`` never imports ``mnb.worker``.  The
worker installs a sink; training code emits events into it::

    from mnb.megatron import events
    events.set_sink(lambda kind, payload: send_to_controller(kind, payload))
    events.emit("progress", {"step": 3, "steps": 10, "loss": 5.1, ...})

Kinds emitted by mnb.megatron: ``"progress"`` (one per step, from the rank
that holds the loss) and ``"run_record"`` (one per train() call, every rank).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

Sink = Callable[[str, dict], Any]

_lock = threading.Lock()
_sink: Sink | None = None
_records: list[dict] = []
_flushers: list[Callable[[], Any]] = []


def set_sink(fn: Sink | None) -> None:
    """Install (or with None, remove) the function that receives events."""
    global _sink
    if fn is not None and not callable(fn):
        raise TypeError(f"sink must be callable or None, got {type(fn).__name__}")
    _sink = fn


def emit(kind: str, payload: dict) -> None:
    """Send one event to the sink; a no-op when no sink is installed."""
    sink = _sink
    if sink is not None:
        sink(kind, payload)


def publish_record(record: dict) -> None:
    """Keep a run record for :func:`take_records` and emit it as ``"run_record"``."""
    with _lock:
        _records.append(record)
    emit("run_record", record)


def on_take(fn: Callable[[], Any]) -> None:
    """Run ``fn`` first in every :func:`take_records` (a recorder closes the run it still holds open)."""
    if fn not in _flushers:
        _flushers.append(fn)


def take_records() -> list[dict]:
    """Return and forget the records published since the last call (open runs are closed first)."""
    for flush in list(_flushers):
        flush()
    with _lock:
        taken = list(_records)
        _records.clear()
    return taken
