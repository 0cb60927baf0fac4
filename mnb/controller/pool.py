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

Nothing here imports torch.  Every wait is bounded and watches the ranks
(:mod:`mnb.controller.collector`); the pool alone decides what follows:

- a rank that fails while the others still run the cell is shown at once;
  the others get ``grace_s`` to finish, then are interrupted, and the cell
  ends with one :class:`CompositeRankError` whose first entry is the root cause;
- ranks that do not return after an interrupt (blocked in a collective: gloo
  cannot abort a wait) or that died are replaced: the pool restarts every
  process in the background with the same size, device and layout, says so in
  one line, and the next request waits for it;
- Jupyter's interrupt is forwarded to the ranks and ends the cell with one line.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import psutil

from mnb.config import ParallelConfig
from mnb.controller import reports
from mnb.controller.collector import Collector, Outcome
from mnb.controller.guards import NO_LATCH, InterruptLatch, exclusive
from mnb.controller.launcher import LaunchSpec, Launcher, reachable_address, resolve_device
from mnb.controller.output import coords_label
from mnb.controller.start_timings import Stage, format_stages, rank_stages
from mnb.controller.registry import set_last_run
from mnb.controller.transport import Transport
from mnb.errors import (CellTimeoutError, CompositeRankError, PoolError, RankDiedError, RankError, RequestRefused,
                        interrupted)
from mnb.protocol import ConnectionInfo, Message, new_key
from mnb.timeouts import (ASK_TIMEOUT_S, DEATH_REPORT_WAIT_S, DEFAULT_GRACE_S, EXIT_TEARDOWN_GRACE_S,
                          REMOTE_RANK_SILENCE_S, SHUTDOWN_WAIT_S, START_TIMEOUT_S, TEARDOWN_GRACE_S, VALUES_TIMEOUT_S)
from mnb.values import ValueDecodeError, decode_values, encode_push

if TYPE_CHECKING:
    from mnb.controller.slurm import SlurmRequest

log = logging.getLogger(__name__)

_POOLS: "weakref.WeakSet[Pool]" = weakref.WeakSet()



def make_launcher(spec: LaunchSpec) -> Launcher:
    """The launcher ``spec`` asks for: torchrun on this host, or one Slurm job (``spec.slurm``).

    Chosen here, above both launchers, so ``slurm.py`` (a ``Launcher``) and ``launcher.py``
    never import each other.
    """
    if spec.slurm is not None:
        from mnb.controller.slurm import SlurmLauncher

        return SlurmLauncher(spec)
    return Launcher(spec)


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


class Pool:
    """A running set of ranks.  Create with :meth:`Pool.start`."""

    def __init__(self, spec: LaunchSpec, bind_ip: str, start_timeout_s: float, cell_timeout_s: float | None,
                 grace_s: float = DEFAULT_GRACE_S, owns_workdir: bool = False):
        self.spec = spec
        self.bind_ip = bind_ip
        self.start_timeout_s = start_timeout_s
        self.cell_timeout_s = cell_timeout_s
        self.grace_s = grace_s
        self.ranks: dict[int, RankInfo] = {}
        self.layout = ParallelConfig().resolve(spec.world_size)
        self.startup_s: float | None = None
        self.event_handlers: list[Callable[[int, str, dict], None]] = []
        self.last_cell_records: list[dict[str, Any]] = []
        self.restarts = 0
        """How many times the pool replaced its processes on its own."""
        self._broken: str | None = None
        self._lock = threading.RLock()
        self._lock_holder = ""
        self._latches: dict[int, InterruptLatch] = {}  # thread id -> the latch of its request (guards.py)
        self._transport: Transport | None = None
        self._launcher: Launcher | None = None
        self._owns_workdir = owns_workdir
        self._relaunch: threading.Thread | None = None
        self._relaunch_error: str | None = None
        self._cancel_relaunch = threading.Event()
        self._stray_lines = 0
        self.environ_at_start = dict(os.environ)
        """The kernel's environment the ranks inherited (``kernel_context`` sends what changed since)."""
        self.start_timings: str | None = None
        """Where the last start's seconds went, for the rank ready last (``%mnb start --timings``)."""

    # ------------------------------------------------------------ lifecycle
    @classmethod
    def start(
        cls,
        nproc: int | None = None,
        *,
        device: str = "auto",
        gpus: list[int] | None = None,
        timeout: float = START_TIMEOUT_S,
        cell_timeout: float | None = None,
        grace: float = DEFAULT_GRACE_S,
        nnodes: int = 1,
        rdzv_endpoint: str | None = None,
        bind_ip: str = "127.0.0.1",
        workdir: str | Path | None = None,
        threads_per_rank: int | None = None,
        extra_env: dict[str, str] | None = None,
        slurm: "SlurmRequest | None" = None,
    ) -> "Pool":
        """Validate the request, launch torchrun and wait until every rank said hello.

        With ``slurm`` (a :class:`~mnb.controller.slurm.SlurmRequest`) the ranks run as one Slurm
        job of ``slurm.nodes`` nodes instead (``nproc`` is then per node; ``nnodes`` and
        ``rdzv_endpoint`` come from the allocation).
        """
        if slurm is not None:
            from mnb.controller.slurm import require_slurm, shared_pool_dir

            require_slurm()
            if gpus is not None or nnodes != 1 or rdzv_endpoint:
                raise ValueError("--slurm chooses the nodes and GPUs: drop --gpus, --nnodes and --rdzv-endpoint "
                                 "(use --nodes and --gpus-per-node)")
            device, nproc = slurm.resolve(device, nproc)
            nnodes = slurm.nodes
            if bind_ip.startswith("127.") or bind_ip in ("localhost", "::1"):
                print(f"mnb: the controller listens on {bind_ip} (loopback): only ranks on this host can "
                      "reach it; for nodes of the cluster add --ip 0.0.0.0 (or this host's address on their "
                      "network)", flush=True)
            if workdir is None:
                workdir = tempfile.mkdtemp(prefix="mnb-pool-", dir=shared_pool_dir())
                owns = True
        else:
            device, nproc = resolve_device(device, nproc, gpus)
            owns = workdir is None
        if nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {nnodes}")
        if grace < 0:
            raise ValueError(f"grace must be >= 0 seconds, got {grace}")
        if nnodes > 1 and not rdzv_endpoint and slurm is None:
            rdzv_endpoint = f"{socket.gethostname()}:29400"
        work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="mnb-pool-"))
        work.mkdir(parents=True, exist_ok=True)
        spec = LaunchSpec(
            nproc_per_node=nproc,
            device=device,
            connection_file=work / "pool.json",
            log_file=work / ("job.log" if slurm is not None else "torchrun.log"),
            gpus=gpus,
            nnodes=nnodes,
            rdzv_endpoint=rdzv_endpoint,
            threads_per_rank=threads_per_rank,
            loopback=bind_ip.startswith("127."),
            extra_env=dict(extra_env or {}),
            slurm=slurm,
        )
        pool = cls(spec, bind_ip, timeout, cell_timeout, grace_s=grace, owns_workdir=owns)
        try:
            pool._launch()
        except BaseException:
            pool._remove_files()
            raise
        _POOLS.add(pool)
        return pool

    def _launch(self) -> None:
        t0 = time.perf_counter()
        key = new_key()
        self.spec.connection_file.parent.mkdir(parents=True, exist_ok=True)
        transport = Transport(key, ip=self.bind_ip)
        transport.expect(self.spec.world_size)
        ConnectionInfo(
            address=reachable_address(transport.address),
            key=key,
            world_size=self.spec.world_size,
            controller_pid=os.getpid(),
            controller_host=socket.gethostname(),
            controller_started=psutil.Process().create_time(),
        ).write(self.spec.connection_file)
        launcher = make_launcher(self.spec)
        self._transport, self._launcher = transport, launcher
        self.ranks = {}  # a new table, never one emptied under a thread iterating it
        self._broken = None
        self.layout = ParallelConfig().resolve(self.spec.world_size)
        launched_at = time.time()  # wall clock: the ranks' start-up stages are compared with it
        try:
            launcher.start()
        except BaseException:
            self._teardown()
            raise
        if self.spec.nnodes > 1 and self.spec.slurm is None:
            print(
                f"Waiting for {self.spec.nnodes - 1} more node(s). On each, with the connection file "
                f"copied to the same path, run:\n  {self.spec.remote_command()}"
            )
        try:
            self._await_hellos(transport, launcher, launched_at)
        except BaseException:
            self._teardown()
            raise
        self.startup_s = time.perf_counter() - t0

    def _await_hellos(self, transport: Transport, launcher: Launcher, launched_at: float) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        ready: dict[int, RankInfo] = {}
        last_stages: list[Stage] = []
        while len(ready) < self.spec.world_size:
            if self._cancel_relaunch.is_set():
                raise PoolError("the start was cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PoolError(launcher.not_ready_error(len(ready), self.spec.world_size, self.start_timeout_s))
            if launcher.returncode() is not None:
                raise PoolError(
                    f"torchrun exited with code {launcher.returncode()} before all ranks were ready; "
                    f"log {self.spec.log_file}:\n" + launcher.log_tail()
                )
            try:
                message = transport.get(timeout=min(0.2, remaining))
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
                device_name=message.get("device_name", ""), torch_version=message.get("torch", ""),
                megatron_version=message.get("megatron", ""),
            )
            ready[info.rank] = info
            launcher.adopt(info.rank, info.pid, local)
            if message.get("startup"):
                last_stages = rank_stages(launched_at, message["startup"], time.time(), local)
                last_rank = info.rank
        self.ranks = dict(sorted(ready.items()))  # one assignment: readers see the old table or the new
        if last_stages:
            self.start_timings = format_stages(last_stages, time.time() - launched_at, last_rank)

    def stop(self) -> None:
        """Shut ranks down, end every process the pool started, remove its folder and secret."""
        self._join_relaunch(cancel=True)
        if self._transport is not None:
            for rank, info in self.ranks.items():
                if info.state == "idle":
                    self._transport.send(rank, Message("shutdown", header={}))
            deadline = time.monotonic() + SHUTDOWN_WAIT_S
            while self._launcher and self._launcher.returncode() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        self._teardown()
        self._remove_files()

    def _teardown(self, grace_s: float = TEARDOWN_GRACE_S) -> None:
        """End every process of the pool (SIGTERM, SIGKILL after ``grace_s``; 0: SIGKILL at once)."""
        if self._launcher is not None:
            self._launcher.stop(grace_s=grace_s)
        if self._transport is not None:
            self._transport.close()
        self._transport = None
        for info in self.ranks.values():
            info.state = "dead"
        self._broken = self._broken or "the pool was stopped"

    def _remove_files(self) -> None:
        """The connection file holds the pool's secret: remove it, and the folder mnb made."""
        if self._owns_workdir:
            shutil.rmtree(self.workdir(), ignore_errors=True)
        else:
            for path in (self.spec.connection_file, self.spec.connection_file.with_name("pool.json.tmp")):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def restart(self) -> "Pool":
        """Stop every process and start the same pool again (same size, device, GPUs; default layout)."""
        self._join_relaunch(cancel=True)
        self._teardown()
        self._launch()
        return self

    # --------------------------------------------------------- self-repair
    def _restart_in_background(self, why: str) -> str:
        """Replace every process (same size, device and layout) without blocking the cell; one line says so."""
        layout = self.layout
        if self.spec.nnodes > 1:
            self._teardown(grace_s=0)
            self._broken = why
            if self.spec.slurm is not None:
                return (f"{why}; the pool's Slurm job spans {self.spec.nnodes} nodes and was cancelled: "
                        "run %mnb restart to submit a new one")
            return (f"{why}; the pool spans {self.spec.nnodes} hosts, so mnb cannot restart it on its own: "
                    "run %mnb restart, then the join command on the other hosts")
        self._relaunch_error = None
        self.restarts += 1
        for info in self.ranks.values():
            info.state = "dead"
        self._relaunch = threading.Thread(target=self._relaunch_main, args=(layout,), name="mnb-restart",
                                          daemon=True)
        self._relaunch.start()
        return (f"mnb is restarting all {self.world_size} ranks ({why}); names defined in earlier cells are "
                f"gone, the layout {layout.describe()} stays, and the next cell waits for the new ranks.")

    def _relaunch_main(self, layout: ParallelConfig) -> None:
        try:
            self._teardown(grace_s=0)  # stuck or dead ranks: nothing to wait for
            if self._cancel_relaunch.is_set():
                return
            self._launch()
            if layout != self.layout:
                outcome = self._exchange("execute", sorted(self.ranks),
                                         {"code": "None", "layout": layout.as_dict(), "want_value": False},
                                         timeout=self.start_timeout_s, stream=False)
                self._absorb(outcome)
                failed = [m for m in outcome.replies.values() if not m.get("ok")]
                if failed or outcome.waiting:
                    raise PoolError(f"restoring the layout {layout.describe()} failed: "
                                    + "; ".join(f"{m.get('ename')}: {m.get('evalue')}" for m in failed))
        except BaseException as exc:  # reported to the next request, which cannot run without ranks
            if self._cancel_relaunch.is_set():  # Pool.stop()/restart() cancelled it: nothing failed
                log.debug("automatic restart cancelled: %s: %s", type(exc).__name__, exc)
                return
            self._relaunch_error = f"{type(exc).__name__}: {exc}"
            log.warning("automatic restart failed: %s", self._relaunch_error)

    def _join_relaunch(self, cancel: bool = False) -> None:
        thread = self._relaunch
        if thread is None:
            return
        if thread.is_alive():
            if cancel:
                self._cancel_relaunch.set()
                if self._launcher is not None:
                    self._launcher.stop(grace_s=0)  # its hello wait sees torchrun exit and returns
            else:
                print("mnb: waiting for the restarted ranks...", flush=True)
            latch = self._latch()
            try:
                while thread.is_alive():
                    thread.join(0.1)
                    if latch.take():
                        raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise interrupted("stopped waiting for the restarting ranks; they go on starting "
                                  "in the background") from None
        self._relaunch = None
        self._cancel_relaunch.clear()
        if self._relaunch_error and not cancel:
            error, self._relaunch_error = self._relaunch_error, None
            self._broken = f"the automatic restart failed ({error})"

    @property
    def restarting(self) -> bool:
        return self._relaunch is not None and self._relaunch.is_alive()

    @property
    def running(self) -> bool:
        return self.restarting or (self._transport is not None and self._broken is None)

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def pids(self) -> list[int]:
        return self._launcher.all_pids() if self._launcher else []

    def launch_description(self) -> str | None:
        """How the ranks were launched where the rank table does not say it (the Slurm job and its state)."""
        return self._launcher.describe() if self._launcher is not None else None

    def descendants(self) -> list[int]:
        """PIDs of every live process the pool started: torchrun, ranks, and what the ranks started."""
        return [p.pid for p in self._launcher.descendants()] if self._launcher else []

    def workdir(self) -> Path:
        return self.spec.connection_file.parent

    # ------------------------------------------------------------ requests
    @exclusive
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
        grace: float | None = None,
        kernel: dict[str, Any] | None = None,
    ) -> dict[int, Any]:
        """Run ``code`` on ``ranks`` (all by default); return {rank: value of the last expression}.

        Output streams live, labelled by rank.  An exception on any rank raises
        one :class:`CompositeRankError`, the first failure first; ranks still
        running ``grace`` seconds (default: the pool's) after a failure are
        stopped and reported with where they waited.  Past ``timeout`` seconds a
        :class:`CellTimeoutError` carries each stuck rank's stack.  Figures and
        ``display()`` calls of ``display_ranks`` appear inline; with
        ``show_result`` (as ``%%megatron`` does) so does the last expression.  ``kernel``: the
        notebook's environment changes for the ranks (``mnb.controller.kernel_context``).
        """
        targets = self._targets(ranks)
        header: dict[str, Any] = {
            "code": code, "display_ranks": list(display_ranks), "want_value": True, "show_result": show_result,
        }
        if kernel:
            header["kernel"] = kernel
        if layout is not None:
            try:
                resolved = layout.resolve(self.world_size)
            except ValueError as exc:
                raise RequestRefused(str(exc)) from None
            if resolved != self.layout:
                if len(targets) != self.world_size:
                    raise RequestRefused(
                        f"changing the layout ({self.layout.describe()} -> {resolved.describe()}) "
                        f"needs every rank, but the cell runs on {len(targets)} of {self.world_size}; "
                        "drop --ranks or change the layout in a cell of its own"
                    )
                header["layout"] = resolved.as_dict()
                for rank in targets:  # label this cell's output with the coordinates it will have
                    self.ranks[rank].coords = resolved.coordinates(rank)
                self.layout = resolved
        outcome = self._exchange("execute", targets, header, timeout=timeout, stream=not quiet, grace=grace)
        errors, values = self._absorb(outcome)
        self._raise_for(outcome, targets, errors)
        return values

    @exclusive
    def run_script(
        self,
        path: str | os.PathLike,
        args: Iterable[str] = (),
        ranks: Iterable[int] | None = None,
        timeout: float | None = None,
        *,
        display_ranks: Iterable[int] = (0,),
        quiet: bool = False,
        grace: float | None = None,
        kernel: dict[str, Any] | None = None,
    ) -> None:
        """Run a script written for torchrun on the ranks, unmodified (what ``%mnb run`` does)::

            pool.run_script("train.py", ["--lr", "3e-4"])    # as torchrun --nproc-per-node N train.py --lr 3e-4

        The ranks give it ``__name__ == "__main__"``, ``sys.argv``, torchrun's environment, and
        adopt its ``init_process_group``, ``set_device`` and Megatron parallel-state calls
        (``mnb.worker.script``, ``mnb.megatron.adopt``); its globals stay for later cells and the
        pool's layout is restored after it.  Output, errors, timeouts and interrupts are a cell's.
        ``kernel``: the notebook's cwd and environment changes, for the run
        (``mnb.controller.kernel_context``, ``mnb.worker.sandbox``).
        """
        script = Path(path).expanduser()
        if not script.is_file():
            raise FileNotFoundError(f"no script {str(script)!r} (relative paths start in {os.getcwd()})")
        targets = self._targets(ranks)
        header: dict[str, Any] = {
            "code": "", "script": {"path": str(script.resolve()), "args": [str(a) for a in args]},
            "ranks": targets, "display_ranks": list(display_ranks), "want_value": False, "show_result": False,
        }
        if kernel:
            header["kernel"] = kernel
        outcome = self._exchange("execute", targets, header, timeout=timeout, stream=not quiet, grace=grace)
        for rank, reply in outcome.replies.items():  # label by the pool's coordinates, not the script's
            reply.header["coords"] = self.ranks[rank].coords
        errors, _ = self._absorb(outcome)
        records = self.last_cell_records
        if not (outcome.died or outcome.unreleased or outcome.waiting):
            # Every rank is idle: rebuild the pool's layout (collectives) in a request of its own.
            after = self._exchange("execute", targets, {"code": "None", "after_script": True, "want_value": False},
                                   timeout=self.start_timeout_s, stream=False)
            errors += self._absorb(after)[0]
            self.last_cell_records = records
            if after.died or after.unreleased or after.waiting or after.timed_out:
                outcome = after
        self._raise_for(outcome, targets, errors)

    def _absorb(self, outcome: Outcome) -> tuple[list[RankError], dict[int, Any]]:
        """Coordinates, layout, run records and values of an execute's replies (in arrival order)."""
        errors: list[RankError] = []
        values: dict[int, Any] = {}
        records: list[dict[str, Any]] = []
        last_records: list[dict[str, Any]] = []  # each rank's last training of the cell: mnb.last_run
        for rank, reply in outcome.replies.items():
            info = self.ranks[rank]
            info.coords = reply.get("coords") or info.coords
            if reply.get("layout"):
                self.layout = ParallelConfig(**reply["layout"])
            payload = reply.payload or {}
            records.extend(payload.get("records") or [])
            last_records.extend((payload.get("records") or [])[-1:])
            if reply.get("payload_error") and reply.get("ok"):
                errors.append(RankError(
                    rank=rank, ename="UnpicklingError", label=info.label(self.layout.as_dict()),
                    evalue=f"the notebook kernel could not rebuild this rank's result: {reply['payload_error']}",
                ))
            elif reply.get("ok"):
                values[rank] = payload.get("value")
            elif reply.get("ename") != "KeyboardInterrupt" or not (outcome.interrupted or rank in outcome.waiting):
                errors.append(self._rank_error(rank, reply))  # not the interrupt mnb itself sent
        self.last_cell_records = records
        if last_records:  # a cell that trained twice: the second training, not a mix of both
            set_last_run(sorted(last_records, key=lambda r: r.get("rank", 0)))
        return errors, dict(sorted(values.items()))

    @exclusive
    def push(self, namespace: dict[str, Any], ranks: Iterable[int] | None = None) -> None:
        """Bind names on the ranks: ``pool.push({"lr": 1e-3})``.

        Each name is pickled here first: what the ranks could not rebuild (a lambda,
        a function or class of the notebook, an open file, a lock) raises TypeError
        naming it before any rank is touched.
        """
        encoded = encode_push(namespace)  # raises before any rank is touched
        self._raise_errors(self._request("push", self._targets(ranks), {"encoded": True}, payload=encoded,
                                         timeout=VALUES_TIMEOUT_S))

    @exclusive
    def pull(self, name: str | list[str], ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """Read a name (or names) from the ranks: ``{rank: value}`` (tensors arrive as numpy).

        Values the kernel cannot rebuild without torch (torch functions, models,
        objects of cell-defined classes) arrive as ``mnb.values.Unportable`` notes
        showing their repr and why; a value that still fails to decode raises one
        CompositeRankError naming the name(s) and rank(s), and the ranks stay idle.
        """
        names = [name] if isinstance(name, str) else list(name)
        replies = self._request("pull", self._targets(ranks), {"names": names}, timeout=VALUES_TIMEOUT_S)
        self._raise_errors(replies)
        pulled: dict[int, dict[str, Any]] = {}
        errors, failed = [], []
        for rank, reply in sorted(replies.items()):
            try:
                pulled[rank] = decode_values(reply.payload or {})
            except ValueDecodeError as exc:
                failed += [n for n in exc.problems if n not in failed]
                errors.append(RankError(rank=rank, ename="ValueDecodeError", evalue=str(exc),
                                        label=self.ranks[rank].label(self.layout.as_dict())))
        if errors:
            raise CompositeRankError(
                errors, cell_ranks=sorted(replies),
                headline=(f"pull: the notebook kernel cannot rebuild {', '.join(map(repr, failed))} from "
                          f"rank(s) {[e.rank for e in errors]}; the values stay on the ranks (pull plain data "
                          "instead, e.g. x.tolist() or str(x) computed in a %%megatron cell)"),
            )
        if isinstance(name, str):
            return {rank: values[name] for rank, values in pulled.items()}
        return pulled

    def status(self) -> list[dict[str, Any]]:
        """Per rank: pid, host, state, device, memory in use, layout, torch and megatron-core versions.

        Answered by each rank's I/O thread, also while a cell, a background run
        or an automatic restart holds the pool.
        """
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()
        transport = self._transport
        restarting = self.restarting
        alive = [r for r, i in self.ranks.items() if i.state != "dead"]
        asking = transport is not None and alive and not restarting
        answers = transport.ask("status", alive, ASK_TIMEOUT_S) if asking else {}
        rows = []
        for rank, info in sorted(self.ranks.items()):
            reply = answers.get(rank)
            state = "restarting" if restarting else info.state
            if reply is not None and state == "idle" and reply.get("busy"):
                state = "busy"
            if reply is None and state not in ("dead", "restarting"):
                state = f"{state} (no answer)"
            rows.append({
                "rank": rank, "pid": info.pid, "host": info.host, "state": state, "device": info.device,
                "memory_bytes": reply.get("memory_bytes") if reply else None,
                "layout": self.layout.describe(), "coords": info.label(self.layout.as_dict()),
                "torch": info.torch_version, "megatron": info.megatron_version,
            })
        return rows

    def stacks(self, ranks: Iterable[int] | None = None) -> dict[int, str]:
        """Each rank's current Python stack (main thread), e.g. to see where a cell hangs.

        Answered by each rank's I/O thread, also while another request runs.
        """
        transport = self._transport
        if transport is None or self.restarting:
            return {}
        targets = [r for r in (ranks if ranks is not None else self.ranks)
                   if r in self.ranks and self.ranks[r].state != "dead"]
        return {r: m.get("stacks", "") for r, m in sorted(transport.ask("stacks", targets, ASK_TIMEOUT_S).items())}

    # ------------------------------------------------------------ internals
    def _targets(self, ranks: Iterable[int] | None) -> list[int]:
        self._join_relaunch()
        if self._transport is None and self._broken is None:
            raise PoolError("the pool is not running; start it with %mnb start (or %mnb restart)")
        if self._broken:
            raise PoolError(f"{self._broken}; run %mnb restart to bring the pool back")
        targets = sorted(self.ranks) if ranks is None else sorted(set(ranks))
        bad = [r for r in targets if r not in self.ranks]
        if bad or not targets:
            raise RequestRefused(
                f"rank(s) {bad or '(none)'} not in this pool of world size {self.world_size} "
                f"(valid: 0-{self.world_size - 1})"
            )
        self._drain()
        busy = [r for r in targets if self.ranks[r].state == "busy"]
        if busy:  # a request that was never answered: replace the ranks rather than refuse forever
            raise PoolError(self._restart_in_background(f"rank(s) {busy} never answered an earlier request"))
        return targets

    def _drain(self) -> None:
        """Handle messages that arrived between requests (late output of ended cells is dropped)."""
        if self._transport is None:
            return
        while True:
            try:
                message = self._transport.inbox.get_nowait()
            except queue.Empty:
                break
            self._handle_stray(message)
        if self._stray_lines:
            log.info("dropped %d late output line(s) of earlier cells", self._stray_lines)
            self._stray_lines = 0

    def _handle_stray(self, message: Message) -> None:
        """A message of a request that already ended: never replayed into the current cell."""
        info = self.ranks.get(message.get("rank"))
        if info is None:
            return
        if message.type == "reply" and info.state == "busy" and message.id == info.request_id:
            info.state, info.request_id = "idle", None
        elif message.type == "stream":
            self._stray_lines += message["text"].count("\n") or 1

    def _any_dead(self) -> bool:
        """Whether a rank of the pool has gone: its process (this host) or its heartbeat (another host)."""
        launcher, transport = self._launcher, self._transport
        if launcher is None or transport is None:
            return True
        if launcher.returncode() is not None or launcher.dead_ranks():
            return True
        now = time.monotonic()
        return any(not info.local and now - transport.last_heartbeat.get(rank, now) > REMOTE_RANK_SILENCE_S
                   for rank, info in self.ranks.items())

    def _exchange(self, kind: str, targets: list[int], header: dict[str, Any], *, payload: Any = None,
                  timeout: float | None = None, stream: bool = True, grace: float | None = None) -> Outcome:
        """Send one request to ``targets`` and wait for its outcome (no error raised here)."""
        message = Message(kind, header=header, payload=payload)
        transport = self._transport
        layout = self.layout.as_dict()
        collector = Collector(
            transport, message.id, targets, {r: self.ranks[r].label(layout) for r in targets},
            timeout_s=timeout if timeout is not None else self.cell_timeout_s,
            grace_s=self.grace_s if grace is None else grace, stream=stream, any_dead=self._any_dead,
            event_handlers=self.event_handlers, on_stray=self._handle_stray,
        )
        for rank in targets:
            self.ranks[rank].state, self.ranks[rank].request_id = "busy", message.id
            transport.send(rank, message)
        outcome = collector.wait(self._latch())
        for rank in outcome.replies:
            self.ranks[rank].state, self.ranks[rank].request_id = "idle", None
        return outcome

    def _request(self, kind: str, targets: list[int], header: dict[str, Any], *, payload: Any = None,
                 timeout: float | None = None, stream: bool = True) -> dict[int, Message]:
        """A request whose error replies the caller handles; deaths, hangs and interrupts raise here."""
        outcome = self._exchange(kind, targets, header, payload=payload, timeout=timeout, stream=stream)
        self._raise_for(outcome, targets, [])
        return dict(sorted(outcome.replies.items()))

    def _raise_for(self, outcome: Outcome, targets: list[int], errors: list[RankError]) -> None:
        """Turn an outcome into the one error the notebook shows, repairing the pool first."""
        if outcome.died:
            raise self._died_error()
        note = ""
        if outcome.unreleased:
            note = self._restart_in_background(f"rank(s) {outcome.unreleased} could not be released")
        if outcome.interrupted:
            raise interrupted(reports.interrupt_line(outcome, targets) + (f"\n{note}" if note else ""))
        if outcome.timed_out:
            raise CellTimeoutError(reports.timeout_text(outcome, targets, self._labels(), note), outcome.stacks)
        if errors or outcome.waiting:
            raise reports.failure_error(errors, outcome, targets, self._labels(), note)

    def _latch(self) -> InterruptLatch:
        """This thread's request's interrupt latch (every rank gets a request or none: see guards.py)."""
        return self._latches.get(threading.get_ident(), NO_LATCH)

    def _labels(self) -> dict[int, str]:
        layout = self.layout.as_dict()
        return {rank: info.label(layout) for rank, info in self.ranks.items()}

    def _rank_error(self, rank: int, reply: Message) -> RankError:
        return RankError(rank=rank, ename=reply.get("ename", "Error"), evalue=reply.get("evalue", ""),
                         traceback=reply.get("traceback", ""), label=self.ranks[rank].label(self.layout.as_dict()))

    def _died_error(self) -> RankDiedError:
        """Say how each rank ended (the first failure first), then replace the pool's processes."""
        deaths = self._launcher.deaths(DEATH_REPORT_WAIT_S) if self._launcher is not None else {}
        now, transport = time.monotonic(), self._transport
        for rank, info in self.ranks.items():
            silent_s = now - transport.last_heartbeat.get(rank, now) if transport is not None else 0.0
            if not info.local and silent_s > REMOTE_RANK_SILENCE_S:
                deaths.setdefault(rank, f"no heartbeat for {REMOTE_RANK_SILENCE_S:.0f} s (host {info.host})")
        deaths = deaths or {r: "stopped with torchrun" for r in self.ranks}
        lines, first = reports.death_lines(deaths, self._labels())
        lines.append(self._restart_in_background(f"rank(s) {first} died"))
        if self.spec.nnodes > 1:
            lines.append(f"torchrun log: {self.spec.log_file}")
        return RankDiedError("\n".join(lines), deaths)

    def _raise_errors(self, replies: dict[int, Message]) -> None:
        errors = [self._rank_error(r, m) for r, m in sorted(replies.items()) if not m.get("ok")]
        if errors:
            raise CompositeRankError(errors, cell_ranks=sorted(replies))

    def __repr__(self) -> str:
        state = "restarting" if self.restarting else ("running" if self.running else (self._broken or "stopped"))
        return f"<mnb.Pool {self.world_size} x {self.spec.device} ranks, {self.layout.describe()}, {state}>"


@atexit.register
def _stop_all() -> None:
    for pool in list(_POOLS):
        try:
            pool._join_relaunch(cancel=True)
            pool._teardown(grace_s=EXIT_TEARDOWN_GRACE_S)
            pool._remove_files()
        except Exception as exc:  # interpreter is exiting; say what could not be cleaned
            log.warning("could not stop %r: %s", pool, exc)
