"""One generation of the pool's processes: a launch, its transport, and the ranks that said hello.

A pool runs one generation at a time.  A start builds one; an automatic restart
builds the next beside the old one's remains and the pool adopts it in one
assignment (:meth:`mnb.controller.repair.Repair.adopt`), so no thread ever sees
a rank table or a transport half replaced.  A generation is built by
:func:`launch`, or from standby ranks started ahead (:mod:`mnb.controller.standby`),
which are wrapped in a :class:`Generation` and adopted the same way.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from mnb.controller.collector import Collector, Outcome
from mnb.controller.guards import InterruptLatch
from mnb.controller.launcher import LaunchSpec, Launcher, reachable_address
from mnb.controller.output import coords_label
from mnb.controller.start_timings import Stage, format_stages, rank_stages
from mnb.controller.transport import Transport
from mnb.errors import PoolError
from mnb.protocol import ConnectionInfo, Message, new_key, version_mismatch
from mnb.timeouts import REMOTE_RANK_SILENCE_S, TEARDOWN_GRACE_S


@dataclass
class RankInfo:
    rank: int
    pid: int
    host: str
    device: str
    backend: str
    local: bool
    coords: dict[str, int]
    device_name: str = ""
    torch_version: str = ""
    megatron_version: str = ""
    """megatron-core's version on this rank (``%mnb status`` shows both)."""
    state: str = "idle"  # idle | busy | dead
    request_id: str | None = None
    """The request this rank is running (``state == "busy"``)."""

    def label(self, layout: dict[str, Any] | None) -> str:
        return coords_label(self.rank, self.coords, layout)


@dataclass
class Generation:
    """The processes of one launch: never changed in size once built, closed once."""

    transport: Transport
    launcher: Launcher
    ranks: dict[int, RankInfo]
    startup_s: float
    start_timings: str | None = None
    files: Path | None = None
    """A folder of this launch's own (a standby's connection file and log), removed on close."""
    closed: bool = False
    _close_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def any_dead(self) -> bool:
        """Whether a rank has gone: its process (this host) or its heartbeat (another host)."""
        if self.closed or self.launcher.returncode() is not None or self.launcher.dead_ranks():
            return True
        now, beats = time.monotonic(), self.transport.last_heartbeat
        return any(not info.local and now - beats.get(rank, now) > REMOTE_RANK_SILENCE_S
                   for rank, info in self.ranks.items())

    def exchange(self, message: Message, targets: list[int], layout: dict[str, Any], latch: InterruptLatch, *,
                 timeout_s: float | None, grace_s: float, stream: bool,
                 event_handlers: list[Callable[[int, str, dict], None]],
                 on_stray: Callable[[Message], None], frames: list[bytes] | None = None) -> Outcome:
        """Send ``message`` to ``targets`` and wait for its outcome (:class:`Collector`; no error raised
        here): the one way a request reaches this generation's ranks.  ``layout`` labels the ranks.

        The targets are busy with it until they reply; the ranks that replied are idle again whatever
        ended the wait; the others stay busy (still running it: the next request replaces them rather
        than queue behind).  ``frames``: the message already sealed (:meth:`Transport.seal`); else it is
        sealed here, before any rank is marked busy: a message over the protocol's limit raises
        :class:`~mnb.errors.MessageTooLarge` with every rank as it was.
        """
        frames = self.transport.seal(message) if frames is None else frames
        collector = Collector(
            self.transport, message.id, targets, {r: self.ranks[r].label(layout) for r in targets},
            timeout_s=timeout_s, grace_s=grace_s, stream=stream, any_dead=self.any_dead,
            event_handlers=event_handlers, on_stray=on_stray,
        )
        for rank in targets:
            self.ranks[rank].state, self.ranks[rank].request_id = "busy", message.id
            self.transport.send_sealed(rank, frames)
        try:
            return collector.wait(latch)
        finally:
            for rank in collector.outcome.replies:
                self.ranks[rank].state, self.ranks[rank].request_id = "idle", None

    def close(self, grace_s: float = TEARDOWN_GRACE_S) -> None:
        """End every process of the launch (SIGTERM, SIGKILL after ``grace_s``) and its socket; once."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        for info in self.ranks.values():
            info.state = "dead"
        try:
            self.launcher.stop(grace_s=grace_s)
        finally:
            self.transport.close()
            if self.files is not None:
                shutil.rmtree(self.files, ignore_errors=True)


def launch(
    spec: LaunchSpec,
    make_launcher: Callable[[LaunchSpec], Launcher],
    *,
    bind_ip: str,
    timeout_s: float,
    cancelled: threading.Event,
    on_launched: Callable[[Launcher], None] = lambda launcher: None,
    on_hello: Callable[[RankInfo], None] = lambda info: None,
) -> Generation:
    """Start torchrun for ``spec`` and wait until every rank said hello (or raise, leaving nothing running).

    ``on_launched`` gets the launcher as soon as torchrun runs (a cancel stops it);
    ``on_hello`` each rank as it is ready (a restart's progress, for ``status``).
    """
    t0 = time.perf_counter()
    launcher = make_launcher(spec)
    transport = open_transport(spec, bind_ip)
    try:
        launched_at = time.time()  # wall clock: the ranks' start-up stages are compared with it
        launcher.start()
        on_launched(launcher)
        if spec.nnodes > 1 and spec.slurm is None:
            print(f"Waiting for {spec.nnodes - 1} more node(s). On each, with the connection file "
                  f"copied to the same path, run:\n  {spec.remote_command()}")
        ranks, timings = await_hellos(spec, transport, launcher, launched_at, timeout_s, cancelled, on_hello)
    except BaseException:
        Generation(transport, launcher, {}, 0.0).close(grace_s=TEARDOWN_GRACE_S)
        raise
    return Generation(transport, launcher, ranks, time.perf_counter() - t0, timings)


def open_transport(spec: LaunchSpec, bind_ip: str) -> Transport:
    """A transport bound on ``bind_ip`` for ``spec``'s ranks, and the connection file (address, key) they read
    to reach it; closed again if the file cannot be written."""
    key = new_key()
    transport = Transport(key, ip=bind_ip)
    try:
        transport.expect(spec.world_size)
        spec.connection_file.parent.mkdir(parents=True, exist_ok=True)
        ConnectionInfo(
            address=reachable_address(transport.address), key=key, world_size=spec.world_size,
            controller_pid=os.getpid(), controller_host=socket.gethostname(),
            controller_started=psutil.Process().create_time(),
        ).write(spec.connection_file)
    except BaseException:
        transport.close()
        raise
    return transport


def hello_refusal(message: Message) -> str | None:
    """Why a hello cannot join this pool: a rank of another protocol version (an older or newer mnb on a
    hand-joined host), named with both versions; ``None`` for a hello of this version."""
    if "protocol_version" not in message.header:  # decode() adds it only where the versions differ
        return None
    return version_mismatch(message["protocol_version"],
                            f"rank {message.get('rank')} on {message.get('host', 'an unknown host')}")


def await_hellos(spec: LaunchSpec, transport: Transport, launcher: Launcher, launched_at: float, timeout_s: float,
                  cancelled: threading.Event, on_hello: Callable[[RankInfo], None]
                  ) -> tuple[dict[int, RankInfo], str | None]:
    """Every rank's hello, read from this launch's own inbox (no other thread reads it)."""
    deadline = time.monotonic() + timeout_s
    ready: dict[int, RankInfo] = {}
    last_stages: list[Stage] = []
    last_rank = 0
    while len(ready) < spec.world_size:
        if cancelled.is_set():
            raise PoolError("the start was cancelled")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PoolError(launcher.not_ready_error(len(ready), spec.world_size, timeout_s))
        if launcher.returncode() is not None:
            raise PoolError(f"torchrun exited with code {launcher.returncode()} before all ranks were ready; "
                            f"log {spec.log_file}:\n" + launcher.log_tail())
        try:
            message = transport.get(timeout=min(0.2, remaining))
        except queue.Empty:
            continue
        if message.type != "hello":
            continue
        refusal = hello_refusal(message)
        if refusal:
            raise PoolError(refusal)
        if message.get("failed"):
            raise PoolError(f"rank {message['rank']} failed to start: {message.get('ename')}: "
                            f"{message.get('evalue')}\n" + message.get("traceback", ""))
        local = message["host"] == socket.gethostname()
        info = RankInfo(
            rank=message["rank"], pid=message["pid"], host=message["host"], device=message["device"],
            backend=message["backend"], local=local, coords=message.get("coords") or {},
            device_name=message.get("device_name", ""), torch_version=message.get("torch", ""),
            megatron_version=message.get("megatron", ""),
        )
        ready[info.rank] = info
        launcher.adopt(info.rank, info.pid, local)
        on_hello(info)
        if message.get("startup"):
            last_stages = rank_stages(launched_at, message["startup"], time.time(), local)
            last_rank = info.rank
    timings = format_stages(last_stages, time.time() - launched_at, last_rank) if last_stages else None
    return dict(sorted(ready.items())), timings
