"""Where a rank's start went: the stages ``%mnb start --timings`` shows.

A rank's start is a chain of slow imports and initialisations (the interpreter, torch, CUDA,
the process group, Megatron-Core).  Each stage is recorded as a wall-clock interval, so the
notebook can line them up against the moment it launched torchrun (same host, same clock);
stages run in parallel threads overlap and the intervals show it.  Wall-clock time is used
(not a monotonic clock) because the other end of the comparison is another process.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

MODULE_LOADED_AT = time.time()
"""When mnb's rank code started running (the interpreter and ``mnb.worker`` are up)."""


def process_started_at() -> float:
    """When this process was created (the end of torchrun's share of the start)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil missing or /proc unreadable: the stage is then unknown
        return MODULE_LOADED_AT


class StartClock:
    """Stages of one rank's start, each ``(name, began, ended)`` in seconds since the epoch."""

    def __init__(self) -> None:
        self.process_started = process_started_at()
        self.stages: list[tuple[str, float, float]] = [("interpreter and mnb.worker", self.process_started,
                                                        MODULE_LOADED_AT)]
        self._lock = threading.Lock()  # stages may end in a helper thread
        self._running: dict[str, float] = {}  # stages begun and not ended (a helper thread's, at the hello)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        began = time.time()
        with self._lock:
            self._running[name] = began
        try:
            yield
        finally:
            with self._lock:
                self._running.pop(name, None)
                self.stages.append((name, began, time.time()))

    def as_header(self) -> dict:
        """What the hello message carries (plain JSON): the stages ended, and those still running
        (``[name, began]``: Megatron-Core's import goes on after the hello, ``mnb/worker/late_start.py``)."""
        with self._lock:
            stages = sorted(self.stages, key=lambda s: s[1])
            running = sorted(([name, began] for name, began in self._running.items()), key=lambda s: s[1])
        return {"process_started": self.process_started, "stages": [list(s) for s in stages],
                "running": running, "hello_sent": time.time()}
