"""The part of a rank's start that goes on after its hello: Megatron-Core, then Megatron's default layout.

A rank says hello once torch is imported and its process group exists (``mnb/worker/boot.py``):
the pool is ready and the notebook's next seconds (the user typing the first cell) overlap the
rest, Megatron-Core's import (seconds: 7-10 s on an H200, BENCHMARKS.md), which began in a helper
thread right after torch's.  :class:`LateStart` is the one owner of whether the rank is ready for
cells: the helper thread imports Megatron-Core (on CPU ranks with the CPU redirection), waits for
the hello, then builds Megatron's default layout (collective: every rank does it in this thread,
none waits for a cell to arrive) and installs the recording; each ``execute`` calls :meth:`finish`
first, which waits for that and tells the notebook so (the ``starting``/``started`` events, one
line in the cell).  What the rank still does is in its hello and its ``status`` answers
(:meth:`doing`).

What the helper thread prints, warns or logs goes to the pool's log, as the start's output did
before the hello, not into the cell that waits (``%mnb start --verbose`` shows it there).

Only the main thread is interrupted (a SIGINT from the I/O thread): Kernel -> Interrupt during the
wait ends the cell and leaves the helper thread running, and the next cell waits again.

A failure in the helper thread before the hello fails the start (the hello says ``failed``, as
for any start); after it, the rank sends its last words (``fatal``: what failed, the error and its
traceback), and exits with code 1: the pool reports a crashed rank and names the error, and no cell
waits for a start that will not end.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable

from mnb.protocol import Message
from mnb.worker.capture import write_this_thread_to_log
from mnb.worker.quiet_warnings import verbose_warnings

IMPORTING = "importing Megatron-Core"
LAYING_OUT = "building Megatron's default layout"
AGREEING = "waiting for the other ranks' default layout"
EXIT_CODE = 1
"""A rank whose start failed after its hello exits with this code (its ``fatal`` message says why)."""


class LateStart:
    """Megatron-Core's import and the default layout, in a helper thread begun right after torch's import."""

    def __init__(self, rank: Any, importer: Callable[[], None], stage: str):
        self.rank = rank
        self.began = time.time()
        self.doing_now = IMPORTING
        """What the helper thread does now (``IMPORTING``, ``LAYING_OUT``); "" once the rank is ready."""
        self.error: BaseException | None = None
        self._importer, self._stage = importer, stage
        self._hello_sent = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()  # the hello and a failure: one of them comes first
        self._after: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name="mnb-late-start", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the main thread
    def send_hello(self, hello: Message) -> None:
        """Send the hello unless the helper thread already failed (then raise its error: a failed start)."""
        with self._lock:
            if self.error is not None:
                raise self.error
            hello.header["starting"] = self.doing()
            self.rank.channel.send(hello)
            self._hello_sent.set()

    def after_ready(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the helper thread once the rank is ready (the GPU presets' background compile)."""
        self._after.append(fn)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def doing(self) -> str:
        """What the start still does, for ``status`` (e.g. ``importing Megatron-Core, 3.1 s so far``); "" when ready."""
        doing = self.doing_now
        return f"{doing}, {time.time() - self.began:.1f} s so far" if doing and not self.ready else ""

    def finish(self) -> None:
        """Return once the rank is ready for a cell, waiting for the helper thread (the cell's first act).

        The wait sends a ``starting`` event (the notebook prints one line) and, once over, a
        ``started`` event with the seconds waited: the cell's timeout does not count them.  A
        KeyboardInterrupt (Kernel -> Interrupt) ends the wait and the cell, never the helper thread.
        """
        if self._ready.is_set():
            return
        waited_from = time.time()
        self.rank.send_event("starting", {"doing": self.doing_now, "elapsed_s": waited_from - self.began})
        while not self._ready.wait(0.1):
            pass  # a failure ends the process from the helper thread (``_fail``)
        self.rank.send_event("started", {"waited_s": time.time() - waited_from})

    # ------------------------------------------------------------ the helper thread
    def _run(self) -> None:
        if not verbose_warnings():
            write_this_thread_to_log()  # the import's notices are the start's, not the waiting cell's
        try:
            with self.rank.clock.stage(self._stage):
                self._importer()
            self._hello_sent.wait()  # the process group exists once the hello is out
            self.doing_now = LAYING_OUT
            self._lay_out()
            self.doing_now = AGREEING
            self._agree()
        except BaseException as exc:  # reported: before the hello by the hello, after it as last words
            self._fail(exc)
            return
        self.doing_now = ""
        self._ready.set()
        for fn in self._after:
            fn()

    def _lay_out(self) -> None:
        """Megatron's default layout, the recording, and ``ps`` for the cells (every rank, this thread)."""
        import torch

        from megatron.core import parallel_state

        from mnb.config import ParallelConfig
        from mnb.megatron import autorecord, layout

        with self.rank.clock.stage("mnb: layout and recording"):
            if self.rank.device.type == "cuda":
                torch.cuda.set_device(self.rank.device)  # the current device is per thread
            layout.apply_layout(ParallelConfig())
            autorecord.install()  # a cell's or script's own get_forward_backward_func calls are measured
        self.rank.namespace["ps"] = parallel_state

    def _agree(self) -> None:
        """Ready only once every rank built the default layout: a world barrier.

        Why: nothing else holds the ranks together here (a cell's layout is agreed through the
        replies the controller collects; this start is not).  A rank whose last group was made could
        take a first cell's other layout and destroy Megatron's gloo groups while a slower rank still
        shook hands on one of them, which then failed ("Gloo connectFullMesh failed ... Connection
        closed by peer": a CI run's ``--pp 2`` first cell).  Before any cell: a cell's collective
        numbers (``mnb.megatron.collectives``) do not count it."""
        import torch.distributed as dist

        with self.rank.clock.stage("mnb: every rank laid out"):
            dist.barrier()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self.error = exc
            if not self._hello_sent.is_set():
                return  # send_hello raises it: the start fails with this error
        from mnb.worker.executor import describe_exception

        outcome = describe_exception(exc)
        doing = self.doing_now
        print(f"mnb rank {self.rank.rank}: {doing} failed after the rank said hello; exiting:\n{outcome.traceback}",
              file=sys.__stderr__, flush=True)
        try:
            self.rank.channel.send(Message("fatal", header={
                "rank": self.rank.rank, "doing": doing, "ename": outcome.ename, "evalue": outcome.evalue,
                "traceback": outcome.traceback}))
            self.rank.channel.close()  # flushes the message out
        finally:
            os._exit(EXIT_CODE)
