"""Standby ranks: the next generation launched ahead of need, so a restart skips the imports.

A start, restart or automatic restart spends most of its seconds in torchrun's agent and
in importing torch and Megatron-Core.  Once a pool is ready (and again after each
adoption) :class:`Standby` launches torchrun for the same size, device, GPUs and
environment in the background, with ``MNB_STANDBY=1``: each rank imports torch, sends
``standby`` and waits for a signed ``go`` before CUDA or any process group, while its
Megatron-Core import goes on in a helper thread (``mnb/worker/boot.py``; a cell that arrives
before that import ends waits for it, ``mnb/worker/late_start.py``).  ``Repair`` adopts it through :meth:`Standby.adopt`
(``go``, then every hello, as a normal start) and wraps it in a ``Generation``.

A standby whose settings no longer match (size, device, GPUs, ``--ip``, threads, the
kernel's environment) is discarded; one that died on its own is replaced, never adopted.
Its ranks watch the kernel like any rank (``mnb/worker/channel.py``), and the kernel ends
every standby at exit, so none outlives its kernel.  A pool's standby survives
``Pool.stop`` (parked here, one per kernel) so that ``%mnb start`` after ``%mnb stop``
adopts it when its settings match.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import psutil

from mnb.controller.generation import Generation, RankInfo, await_hellos, hello_refusal, open_transport
from mnb.controller.launcher import LaunchSpec, Launcher
from mnb.controller.transport import Transport
from mnb.errors import PoolError
from mnb.protocol import STANDBY_ENV, Message
from mnb.units import GIB

log = logging.getLogger(__name__)

MODES = ("off", "on", "auto")
VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})
"""Environment variables that change on their own and say nothing about the ranks."""
CPU_CORES_PER_RANK = 2
CPU_SPARE_CORES = 2
CPU_BYTES_PER_RANK = 2 * GIB
CPU_SPARE_BYTES = 2 * GIB
DEFERRED = "launching once the pool's ranks finished their start"
"""A standby's state while the ranks it would replace still import Megatron-Core (its imports would compete)."""
NOT_BEFORE_POLL_S = 0.5
"""How often a standby asks whether the pool's ranks finished their start before it launches."""

_LIVE: "weakref.WeakSet[Standby]" = weakref.WeakSet()
_parked: "Standby | None" = None


def choose(mode: str, device: str, nproc: int, *, several_hosts: bool) -> tuple[bool, str]:
    """Whether a pool keeps a standby, and the words that say why (what ``auto`` chose).

    auto: on for CUDA pools; for CPU pools only where the machine has cores AND memory to
    spare (``CPU_CORES_PER_RANK`` cores per rank + ``CPU_SPARE_CORES``, and
    ``CPU_BYTES_PER_RANK`` of available memory per rank + ``CPU_SPARE_BYTES``): a standby
    importing torch competes with the cell for the cores.
    """
    if mode not in MODES:
        raise ValueError(f"standby={mode!r}: use one of {', '.join(MODES)}")
    if several_hosts:
        if mode == "on":
            raise ValueError("--standby on needs a pool on this host alone; drop --standby, or use "
                             "--standby off with --nnodes/--slurm")
        return False, "auto chose off: the pool spans several hosts" if mode == "auto" else "off"
    if mode != "auto":
        return mode == "on", mode
    if device == "cuda":
        return True, "auto chose on: a CUDA pool (a standby holds host memory only)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    need_cores = CPU_CORES_PER_RANK * nproc + CPU_SPARE_CORES
    available, need_bytes = psutil.virtual_memory().available, CPU_BYTES_PER_RANK * nproc + CPU_SPARE_BYTES
    if cores < need_cores or available < need_bytes:
        return False, (f"auto chose off: {cores} cores and {available / GIB:.1f} GiB available; a CPU standby "
                       f"of {nproc} ranks wants {need_cores} cores and {need_bytes / GIB:.0f} GiB")
    return True, f"auto chose on: {cores} cores and {available / GIB:.1f} GiB available"


def settings(spec: LaunchSpec, bind_ip: str) -> dict[str, Any]:
    """What a standby must share with the pool that adopts it (compared as a whole)."""
    return {"-n": spec.nproc_per_node, "--device": spec.device, "--gpus": list(spec.gpus or []),
            "--ip": bind_ip, "--threads": spec.threads_per_rank, "--verbose and extra_env": dict(spec.extra_env),
            "environment": {k: v for k, v in os.environ.items() if k not in VOLATILE_ENV}}


def difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Which settings differ, in words ("" when none)."""
    changed = []
    for name in a:
        if a[name] == b.get(name):
            continue
        if name == "environment":
            keys = sorted(k for k in set(a[name]) | set(b[name]) if a[name].get(k) != b[name].get(k))
            changed.append("environment (" + ", ".join(keys[:5]) + (", ..." if len(keys) > 5 else "") + ")")
        else:
            changed.append(f"{name} {a[name]} -> {b.get(name)}")
    return "; ".join(changed)


class Standby:
    """One standby generation: launched in a background thread, adopted or closed once."""

    def __init__(self, spec: LaunchSpec, bind_ip: str, make_launcher: Callable[[LaunchSpec], Launcher],
                 timeout_s: float, not_before: Callable[[], bool] = lambda: True):
        self.settings = settings(spec, bind_ip)
        self.folder = Path(tempfile.mkdtemp(prefix="mnb-pool-standby-"))  # ranks remove mnb-pool-* when orphaned
        self.spec = dataclasses.replace(spec, connection_file=self.folder / "pool.json",
                                        log_file=self.folder / "torchrun.log",
                                        extra_env={**spec.extra_env, STANDBY_ENV: "1"})
        self.bind_ip, self.timeout_s = bind_ip, timeout_s
        self.launcher = make_launcher(self.spec)
        self.transport: Transport | None = None
        self.state = "launching"  # launching | DEFERRED | waiting for go | failed: ... | adopted | closed
        self.pids: dict[int, int] = {}
        self.launched_at = time.time()
        self.ready_s: float | None = None
        """Seconds from the launch to every rank waiting for ``go``."""
        self.waited_s = 0.0
        """Seconds ``adopt`` waited for the standby's imports (0 when it was already waiting for ``go``)."""
        self._not_before = not_before
        """Whether it may launch now: the pool's own ranks finished their start (their Megatron-Core import),
        so the standby's imports do not compete with theirs for the cores (``Repair.ranks_started``)."""
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._prepare, name="mnb-standby", daemon=True)
        _LIVE.add(self)
        self._thread.start()

    # ------------------------------------------------------------ the background thread
    def _prepare(self) -> None:
        try:
            deadline = time.monotonic() + self.timeout_s
            while not self._not_before() and time.monotonic() < deadline:  # polls the pool's ranks
                with self._lock:  # close() sets its state under the lock: never overwritten here
                    if self._closed.is_set():
                        return
                    self.state = DEFERRED
                if self._closed.wait(NOT_BEFORE_POLL_S):
                    return
            with self._lock:
                if self._closed.is_set():
                    return
                self.state = "launching"
            self.launched_at = time.time()
            transport = open_transport(self.spec, self.bind_ip)
            with self._lock:  # close() either sees the transport and torchrun, or they never start
                if self._closed.is_set():
                    transport.close()
                    return
                self.transport = transport
                self.launcher.start()
            deadline = time.monotonic() + self.timeout_s
            while len(self.pids) < self.spec.world_size:
                if self._closed.is_set():
                    return
                if self.launcher.returncode() is not None or time.monotonic() > deadline:
                    self.state = "failed: torchrun exited" if self.launcher.returncode() is not None else \
                        f"failed: not ready within {self.timeout_s:.0f} s"
                    return
                try:
                    message = self.transport.get(timeout=0.2)
                except queue.Empty:
                    continue
                if message.type == "standby":
                    self.pids[message["rank"]] = message["pid"]
                    self.launcher.adopt(message["rank"], message["pid"], message["host"] == socket.gethostname())
                elif message.type == "hello" and hello_refusal(message):
                    self.state = f"failed: {hello_refusal(message)}"
                    return
                elif message.type == "hello" and message.get("failed"):
                    self.state = f"failed: {message.get('ename')}: {message.get('evalue')}"
                    return
            self.ready_s = time.time() - self.launched_at
            self.state = "waiting for go"
        except Exception as exc:  # reported through state; the pool then launches cold
            self.state = f"failed: {type(exc).__name__}: {exc}"

    # ------------------------------------------------------------ what the pool asks
    def alive(self) -> bool:
        """Whether every process is still there (a standby that died on its own is never adopted)."""
        if self._closed.is_set() or self.state.startswith("failed") or self.launcher.returncode() is not None:
            return False
        return not self.launcher.dead_ranks()

    def status(self) -> dict[str, Any]:
        """State, pids (ranks; torchrun), host memory (RSS of every process), seconds to ready."""
        processes = self.launcher.descendants() if not self._closed.is_set() else []
        rss = 0
        for process in processes:
            try:
                rss += process.memory_info().rss
            except psutil.Error:
                pass
        state = self.state if self.alive() or self._closed.is_set() else \
            (self.state if self.state.startswith("failed") else "died")
        return {"state": state, "pids": [self.pids[r] for r in sorted(self.pids)], "torchrun_pid": self.launcher.pid,
                "rss_bytes": rss if processes else None, "ready_s": self.ready_s}

    def adopt(self, timeout_s: float, cancelled: threading.Event,
              on_hello: Callable[[RankInfo], None] = lambda info: None) -> Generation:
        """Send ``go`` and wait for every hello: the standby as the pool's next generation.

        A standby still importing is waited for (it is ahead of a cold launch anyway).
        Raises PoolError (the standby closed) when it cannot be adopted.
        """
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline and not cancelled.is_set():
            self._thread.join(0.1)
        self.waited_s = time.perf_counter() - t0
        if not self.alive() or self.state != "waiting for go" or self.transport is None:
            why = self.status()["state"]
            self.close()
            raise PoolError(f"the standby could not be adopted ({why})")
        self.state = "adopted"
        went = time.time()
        for rank in sorted(self.pids):
            self.transport.send(rank, Message("go", header={}))
        try:
            ranks, timings = await_hellos(self.spec, self.transport, self.launcher, self.launched_at,
                                           max(1.0, deadline - time.monotonic()), cancelled, on_hello)
        except BaseException:
            self.close()
            raise
        _LIVE.discard(self)
        header = (f"adopted a standby launched {went - self.launched_at:.1f} s before (ready for go after "
                  f"{self.ready_s or 0:.1f} s); go -> every hello {time.time() - went:.2f} s")
        return Generation(self.transport, self.launcher, ranks, time.perf_counter() - t0,
                          header + ("\n" + timings if timings else ""), files=self.folder)

    def close(self) -> None:
        """End every process of the standby and remove its folder; once, from any thread."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            if self.state != "adopted":
                self.state = "closed"
        _LIVE.discard(self)
        self._thread.join(5)  # bounded: it watches the close between polls
        try:
            self.launcher.stop(grace_s=0)
        finally:
            if self.transport is not None:
                self.transport.close()
            shutil.rmtree(self.folder, ignore_errors=True)


def park(standby: "Standby | None") -> None:
    """Keep a stopped pool's standby for the next start in this kernel (one at a time)."""
    global _parked
    previous, _parked = _parked, standby
    if previous is not None and previous is not standby:
        previous.close()


PARK_WAIT_S = 15.0
"""How long ``unpark`` waits for a standby still being set up by ``park_when_made`` (nvidia-smi's 10 s + margin)."""
_pending: "threading.Thread | None" = None


def park_when_made(make: Callable[[], "Standby | None"]) -> None:
    """Run ``make`` in a background thread and park the standby it returns (``%load_ext mnb``).

    ``make`` may take a moment (it asks nvidia-smi what the machine has); ``unpark`` and the
    exit hook wait for it, so its standby is either handed over or closed, never lost.
    """
    global _pending

    def run() -> None:
        try:
            standby = make()
        except Exception as exc:  # the first %mnb start launches cold instead; say why in the log
            log.warning("no standby at load: %s: %s", type(exc).__name__, exc)
            return
        if standby is not None:
            park(standby)

    _pending = threading.Thread(target=run, name="mnb-standby-at-load", daemon=True)
    _pending.start()


def _wait_pending() -> None:
    pending = _pending
    if pending is not None and pending is not threading.current_thread():
        pending.join(PARK_WAIT_S)


def unpark() -> "Standby | None":
    """The parked standby, now the caller's (None when there is none)."""
    global _parked
    _wait_pending()
    standby, _parked = _parked, None
    return standby


def parked_status() -> "dict[str, Any] | None":
    """The parked standby's :meth:`Standby.status` (``%mnb status`` without a pool), None when none."""
    standby = _parked
    return standby.status() if standby is not None else None


@atexit.register
def _close_all() -> None:
    _wait_pending()
    for standby in list(_LIVE):
        try:
            standby.close()
        except Exception:  # the interpreter is exiting; the ranks also notice on their own
            pass
