"""The pool: torchrun-launched ranks driven cell by cell from the notebook.

    >>> import mnb
    >>> from mnb.controller import Pool
    >>> pool = Pool.start(nproc=2, device="cpu")        # what %mnb start does
    >>> pool.run("x = rank * 10")
    >>> pool.pull("x")
    {0: 0, 1: 10}
    >>> pool.run("print(ps.get_tensor_model_parallel_world_size())", layout=mnb.ParallelConfig(tp=2))
    [r0-1] 2
    >>> pool.stop()

Nothing here imports torch.  Every wait is bounded and watches the ranks:
a dead rank is reported within a second or two (with its exit code from
torchrun), a cell past its timeout returns with each rank's Python stack,
and Jupyter's interrupt is forwarded to the ranks as a message.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import socket
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from mnb.config import ParallelConfig
from mnb.controller.launcher import LaunchSpec, Launcher, resolve_device
from mnb.controller.collector import Collector
from mnb.controller.output import coords_label
from mnb.controller.registry import set_last_run
from mnb.controller.transport import Transport
from mnb.errors import CompositeRankError, PoolError, RankError
from mnb.protocol import ConnectionInfo, Message, new_key

log = logging.getLogger(__name__)

_POOLS: "weakref.WeakSet[Pool]" = weakref.WeakSet()


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
    state: str = "idle"  # idle | busy | stuck | dead
    stuck_in: str = ""
    cell: str | None = None

    def label(self, layout: dict[str, Any] | None) -> str:
        return coords_label(self.rank, self.coords, layout)


def _exclusive(method: Callable) -> Callable:
    """One request at a time: replies are read from one queue, so a second thread
    (the explorer's background "Run on pool", a sweep) must not wait on it concurrently.
    A request from another thread while one runs is refused at once, never queued
    behind a long training run."""

    @functools.wraps(method)
    def guarded(self: "Pool", *args: Any, **kwargs: Any) -> Any:
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


class Pool:
    """A running set of ranks.  Create with :meth:`Pool.start`."""

    def __init__(self, spec: LaunchSpec, bind_ip: str, start_timeout_s: float, cell_timeout_s: float | None):
        self.spec = spec
        self.bind_ip = bind_ip
        self.start_timeout_s = start_timeout_s
        self.cell_timeout_s = cell_timeout_s
        self.ranks: dict[int, RankInfo] = {}
        self.layout = ParallelConfig().resolve(spec.world_size)
        self.startup_s: float | None = None
        self.event_handlers: list[Callable[[int, str, dict], None]] = []
        self.last_cell_records: list[dict[str, Any]] = []
        self._broken: str | None = None
        self._lock = threading.RLock()
        self._lock_holder = ""
        self._transport: Transport | None = None
        self._launcher: Launcher | None = None

    # ------------------------------------------------------------ lifecycle
    @classmethod
    def start(
        cls,
        nproc: int | None = None,
        *,
        device: str = "auto",
        gpus: list[int] | None = None,
        timeout: float = 180.0,
        cell_timeout: float | None = None,
        nnodes: int = 1,
        rdzv_endpoint: str | None = None,
        bind_ip: str = "127.0.0.1",
        workdir: str | Path | None = None,
        threads_per_rank: int | None = None,
    ) -> "Pool":
        """Validate the request, launch torchrun and wait until every rank said hello."""
        device, nproc = resolve_device(device, nproc, gpus)
        if nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {nnodes}")
        if nnodes > 1 and not rdzv_endpoint:
            rdzv_endpoint = f"{socket.gethostname()}:29400"
        work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="mnb-pool-"))
        work.mkdir(parents=True, exist_ok=True)
        spec = LaunchSpec(
            nproc_per_node=nproc,
            device=device,
            connection_file=work / "pool.json",
            log_file=work / "torchrun.log",
            gpus=gpus,
            nnodes=nnodes,
            rdzv_endpoint=rdzv_endpoint,
            threads_per_rank=threads_per_rank,
        )
        pool = cls(spec, bind_ip, timeout, cell_timeout)
        pool._launch()
        _POOLS.add(pool)
        return pool

    def _launch(self) -> None:
        t0 = time.perf_counter()
        key = new_key()
        self._transport = Transport(key, ip=self.bind_ip)
        self._transport.expect(self.spec.world_size)
        ConnectionInfo(
            address=self._transport.address,
            key=key,
            world_size=self.spec.world_size,
            controller_pid=os.getpid(),
            controller_host=socket.gethostname(),
        ).write(self.spec.connection_file)
        self._launcher = Launcher(self.spec)
        self._launcher.start()
        self.ranks.clear()
        self._broken = None
        self.layout = ParallelConfig().resolve(self.spec.world_size)
        if self.spec.nnodes > 1:
            print(
                f"Waiting for {self.spec.nnodes - 1} more node(s). On each, with the connection file "
                f"copied to the same path, run:\n  {self.spec.remote_command()}"
            )
        try:
            self._await_hellos()
        except BaseException:
            self._teardown()
            raise
        self.startup_s = time.perf_counter() - t0

    def _await_hellos(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        transport, launcher = self._transport, self._launcher
        while len(self.ranks) < self.spec.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PoolError(
                    f"only {len(self.ranks)} of {self.spec.world_size} ranks were ready after "
                    f"{self.start_timeout_s:.0f} s; raise --timeout, or read the log {self.spec.log_file}:\n"
                    + launcher.log_tail()
                )
            if launcher.returncode() is not None:
                raise PoolError(
                    f"torchrun exited with code {launcher.returncode()} before all ranks were ready; "
                    f"log {self.spec.log_file}:\n" + launcher.log_tail()
                )
            try:
                message = transport.inbox.get(timeout=min(0.2, remaining))
            except queue.Empty:
                continue
            if message.type != "hello":
                continue
            if message.get("failed"):
                raise PoolError(
                    f"rank {message['rank']} failed to start: {message.get('ename')}: {message.get('evalue')}\n"
                    + message.get("traceback", "")
                )
            local = message["host"] == socket.gethostname()
            info = RankInfo(
                rank=message["rank"], pid=message["pid"], host=message["host"], device=message["device"],
                backend=message["backend"], local=local, coords=message.get("coords") or {},
                device_name=message.get("device_name", ""),
            )
            self.ranks[info.rank] = info
            launcher.adopt(info.rank, info.pid, local)

    def stop(self) -> None:
        """Shut ranks down and make sure no process of the pool is left."""
        if self._transport is not None:
            for rank, info in self.ranks.items():
                if info.state in ("idle",):
                    self._transport.send(rank, Message("shutdown", header={}))
            deadline = time.monotonic() + 3.0
            while self._launcher and self._launcher.returncode() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        self._teardown()

    def _teardown(self) -> None:
        if self._launcher is not None:
            self._launcher.stop()
        if self._transport is not None:
            self._transport.close()
        self._transport = None
        for info in self.ranks.values():
            info.state = "dead"
        self._broken = self._broken or "the pool was stopped"

    def restart(self) -> "Pool":
        """Stop every process and start the same pool again (same size, device, GPUs)."""
        self._teardown()
        self._launch()
        return self

    @property
    def running(self) -> bool:
        return self._transport is not None and self._broken is None

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def pids(self) -> list[int]:
        return self._launcher.all_pids() if self._launcher else []

    def workdir(self) -> Path:
        return self.spec.connection_file.parent

    # ------------------------------------------------------------ requests
    @_exclusive
    def run(
        self,
        code: str,
        ranks: Iterable[int] | None = None,
        timeout: float | None = None,
        *,
        layout: ParallelConfig | None = None,
        display_ranks: Iterable[int] = (0,),
        show_result: bool = False,
        quiet: bool = False,
    ) -> dict[int, Any]:
        """Run ``code`` on ``ranks`` (all by default); return {rank: value of the last expression}.

        Output streams live, labelled by rank; an exception on any rank raises
        one :class:`CompositeRankError`; past ``timeout`` seconds a
        :class:`CellTimeoutError` carries each stuck rank's stack.  Figures and
        ``display()`` calls of ``display_ranks`` appear inline; with
        ``show_result`` (as ``%%megatron`` does) so does the last expression.
        """
        targets = self._targets(ranks)
        header: dict[str, Any] = {
            "code": code, "display_ranks": list(display_ranks), "want_value": True, "show_result": show_result,
        }
        if layout is not None:
            resolved = layout.resolve(self.world_size)
            if resolved != self.layout:
                if len(targets) != self.world_size:
                    raise ValueError(
                        f"changing the layout ({self.layout.describe()} -> {resolved.describe()}) "
                        f"needs every rank, but the cell runs on {len(targets)} of {self.world_size}; "
                        "drop --ranks or change the layout in a cell of its own"
                    )
                header["layout"] = resolved.as_dict()
                for rank in targets:  # label this cell's output with the coordinates it will have
                    self.ranks[rank].coords = resolved.coordinates(rank)
                self.layout = resolved
        replies = self._request("execute", targets, header, timeout=timeout, stream=not quiet)
        errors = []
        values: dict[int, Any] = {}
        records: list[dict[str, Any]] = []
        for rank, reply in sorted(replies.items()):
            info = self.ranks[rank]
            info.coords = reply.get("coords") or info.coords
            if reply.get("layout"):
                self.layout = ParallelConfig(**reply["layout"])
            payload = reply.payload or {}
            records.extend(payload.get("records") or [])
            if reply.get("ok"):
                values[rank] = payload.get("value")
            else:
                errors.append(
                    RankError(rank=rank, ename=reply.get("ename", "Error"), evalue=reply.get("evalue", ""),
                              traceback=reply.get("traceback", ""), label=info.label(self.layout.as_dict()))
                )
        self.last_cell_records = records
        if records:
            set_last_run(records)
        if errors:
            raise CompositeRankError(errors, cell_ranks=targets)
        return values

    @_exclusive
    def push(self, namespace: dict[str, Any], ranks: Iterable[int] | None = None) -> None:
        """Bind names on the ranks: ``pool.push({"lr": 1e-3})``."""
        if not isinstance(namespace, dict):
            raise TypeError("push takes a dict of {name: value}")
        self._raise_errors(self._request("push", self._targets(ranks), {}, payload=namespace, timeout=60))

    @_exclusive
    def pull(self, name: str | list[str], ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """Read a name (or names) from the ranks: ``{rank: value}`` (tensors arrive as numpy)."""
        names = [name] if isinstance(name, str) else list(name)
        replies = self._request("pull", self._targets(ranks), {"names": names}, timeout=60)
        self._raise_errors(replies)
        if isinstance(name, str):
            return {rank: reply.payload[name] for rank, reply in sorted(replies.items())}
        return {rank: reply.payload for rank, reply in sorted(replies.items())}

    @_exclusive
    def status(self) -> list[dict[str, Any]]:
        """Per rank: pid, host, state, device, memory in use and layout (answered even while busy)."""
        self._drain()
        alive = [r for r, i in self.ranks.items() if i.state != "dead"] if self._transport else []
        answers = self._ask_io_thread("status", alive, timeout_s=3.0)
        rows = []
        for rank, info in sorted(self.ranks.items()):
            reply = answers.get(rank)
            state = info.state
            if reply is not None and state == "idle" and reply.get("busy"):
                state = "busy"
            if reply is None and state not in ("dead",):
                state = f"{state} (no answer)"
            rows.append({
                "rank": rank, "pid": info.pid, "host": info.host, "state": state, "device": info.device,
                "memory_bytes": reply.get("memory_bytes") if reply else None,
                "layout": self.layout.describe(), "coords": info.label(self.layout.as_dict()),
            })
        return rows

    @_exclusive
    def stacks(self, ranks: Iterable[int] | None = None) -> dict[int, str]:
        """Each rank's current Python stack (main thread), e.g. to see where a cell hangs."""
        targets = [r for r in (ranks or self.ranks) if self.ranks[r].state != "dead"]
        return {r: m.get("stacks", "") for r, m in self._ask_io_thread("stacks", targets, 3.0).items()}

    # ------------------------------------------------------------ internals
    def _targets(self, ranks: Iterable[int] | None) -> list[int]:
        if self._transport is None:
            raise PoolError("the pool is not running; start it with %mnb start (or %mnb restart)")
        if self._broken:
            raise PoolError(f"{self._broken}; run %mnb restart to bring the pool back")
        targets = sorted(self.ranks) if ranks is None else sorted(set(ranks))
        bad = [r for r in targets if r not in self.ranks]
        if bad or not targets:
            raise ValueError(
                f"rank(s) {bad or '(none)'} not in this pool of world size {self.world_size} "
                f"(valid: 0-{self.world_size - 1})"
            )
        self._drain()
        stuck = [r for r in targets if self.ranks[r].state == "stuck"]
        if stuck:
            where = "; ".join(f"rank {r}: {self.ranks[r].stuck_in}" for r in stuck)
            raise PoolError(
                f"rank(s) {stuck} are still busy with a cell that timed out ({where}); "
                "wait for them, or run %mnb restart"
            )
        return targets

    def _drain(self) -> None:
        """Handle messages that arrived between requests (late replies free stuck ranks)."""
        if self._transport is None:
            return
        while True:
            try:
                message = self._transport.inbox.get_nowait()
            except queue.Empty:
                return
            self._handle_stray(message)

    def _handle_stray(self, message: Message) -> None:
        rank = message.get("rank")
        info = self.ranks.get(rank)
        if info is None:
            return
        if message.type == "reply" and info.state == "stuck" and message.id == info.cell:
            info.state, info.stuck_in, info.cell = "idle", "", None
        elif message.type == "stream":
            print(f"[{info.label(self.layout.as_dict())} late] {message['text']}", end="")

    def _request(self, kind: str, targets: list[int], header: dict[str, Any], *, payload: Any = None,
                 timeout: float | None = None, stream: bool = True) -> dict[int, Message]:
        message = Message(kind, header=header, payload=payload)
        for rank in targets:
            self.ranks[rank].state, self.ranks[rank].cell = "busy", message.id
            self._transport.send(rank, message)
        return Collector(self, message.id, targets, timeout if timeout is not None else self.cell_timeout_s,
                          stream=stream).wait()

    def _ask_io_thread(self, kind: str, targets: list[int], timeout_s: float) -> dict[int, Message]:
        """status/stacks: answered by each rank's I/O thread, even mid-cell."""
        if self._transport is None or not targets:
            return {}
        message = Message(kind, header={})
        for rank in targets:
            self._transport.send(rank, message)
        answers: dict[int, Message] = {}
        deadline = time.monotonic() + timeout_s
        stash = []
        while len(answers) < len(targets) and time.monotonic() < deadline:
            try:
                reply = self._transport.inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if reply.type == "reply" and reply.id == message.id:
                answers[reply["rank"]] = reply
            else:
                stash.append(reply)
        for item in stash:
            self._transport.inbox.put(item)
        return answers

    def _raise_errors(self, replies: dict[int, Message]) -> None:
        errors = [
            RankError(rank=r, ename=m.get("ename", "Error"), evalue=m.get("evalue", ""),
                      label=self.ranks[r].label(self.layout.as_dict()))
            for r, m in sorted(replies.items()) if not m.get("ok")
        ]
        if errors:
            raise CompositeRankError(errors, cell_ranks=sorted(replies))

    def _mark_broken(self, reason: str) -> None:
        self._broken = reason

    def __repr__(self) -> str:
        state = "running" if self.running else (self._broken or "stopped")
        return f"<mnb.Pool {self.world_size} x {self.spec.device} ranks, {self.layout.describe()}, {state}>"




@atexit.register
def _stop_all() -> None:
    for pool in list(_POOLS):
        try:
            pool._teardown()
        except Exception as exc:  # interpreter is exiting; say what could not be cleaned
            log.warning("could not stop %r: %s", pool, exc)
