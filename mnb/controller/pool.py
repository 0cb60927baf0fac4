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

Nothing here imports torch.  ``Pool`` owns the lifecycle and status; the parts it composes own the rest:

- the requests (``requests.py``): ``run``, ``run_script``, ``push``, ``pull``, ``debug``, the layout
  requests run under and what the last cell left (records, profile folder, failure), handed on
  under the same names;
- the request gate (``gate.py``): one request at a time, its interrupt latch,
  and the only way another thread ends a request (``stop``/``restart``);
- the repair part (``repair.py``): the current generation of processes, the
  relaunch thread, the broken state, and what follows each outcome;
- standby ranks (``standby.py``, ``standby=``): the next generation, launched ahead and
  adopted by a restart, an automatic restart, or a start after a stop in this kernel.

Every wait is bounded and watches the ranks (:mod:`mnb.controller.collector`);
the pool decides what an outcome means:

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
import functools
import logging
import os
import shutil
import socket
import tempfile
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from mnb.config import ParallelConfig
from mnb.controller import hangs
from mnb.controller.gate import RequestGate
from mnb.controller.generation import RankInfo
from mnb.controller.launcher import LaunchSpec, Launcher
from mnb.controller.machine import resolve_device
from mnb.controller import standby as standbys
from mnb.controller.repair import STOPPED, STOPPED_NEXT, Repair
from mnb.controller.requests import Requests
from mnb.controller.transport import Transport
from mnb.fields import check_seconds
from mnb.errors import PoolError
from mnb.protocol import Message
from mnb.units import Text
from mnb.timeouts import (ASK_TIMEOUT_S, DEFAULT_GRACE_S, EXIT_TEARDOWN_GRACE_S, SHUTDOWN_WAIT_S, START_TIMEOUT_S,
                          STOP_REQUEST_WAIT_S)

if TYPE_CHECKING:
    from mnb.controller.slurm import SlurmRequest

log = logging.getLogger(__name__)

_POOLS: "weakref.WeakSet[Pool]" = weakref.WeakSet()

__all__ = ["Pool", "RankInfo", "launch_spec", "make_launcher"]


def make_launcher(spec: LaunchSpec) -> Launcher:
    """The launcher ``spec`` asks for: torchrun on this host, or one Slurm job (``spec.slurm``).

    Chosen here, above both launchers, so ``slurm.py`` (a ``Launcher``) and ``launcher.py``
    never import each other.
    """
    if spec.slurm is not None:
        from mnb.controller.slurm import SlurmLauncher

        return SlurmLauncher(spec)
    return Launcher(spec)


def launch_spec(nproc: int, device: str, work: Path, *, gpus: list[int] | None = None, nnodes: int = 1,
                rdzv_endpoint: str | None = None, threads_per_rank: int | None = None, bind_ip: str = "127.0.0.1",
                extra_env: dict[str, str] | None = None, slurm: "SlurmRequest | None" = None) -> LaunchSpec:
    """The torchrun pool ``Pool.start`` launches for these (resolved) settings, its files in ``work``.

    One place, so the standby begun at ``%load_ext mnb`` (``load_standby.py``) is the pool the
    first ``%mnb start`` with the defaults builds, setting for setting.
    """
    return LaunchSpec(
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


def _request(name: str) -> Callable[..., Any]:
    """``Pool.<name>``: the request of that name, handed to the pool's :class:`Requests` (same signature)."""
    method = getattr(Requests, name)

    @functools.wraps(method)
    def call(self: "Pool", *args: Any, **kwargs: Any) -> Any:
        return method(self._requests, *args, **kwargs)

    return call


def _requests_state(name: str) -> property:
    """``Pool.<name>``: the attribute of the pool's :class:`Requests`, read and written there (one owner)."""
    def get(self: "Pool") -> Any:
        return getattr(self._requests, name)

    def put(self: "Pool", value: Any) -> None:
        setattr(self._requests, name, value)

    return property(get, put, doc=f"The pool's requests' ``{name}`` (:class:`~mnb.controller.requests.Requests`).")



def _check_bind_ip(ip: str) -> None:
    """The controller's address (``--ip``) is one this host can listen on: checked before any folder or rank
    exists (a user trial got ZeroMQ's error through 15 frames of mnb, and an empty pool folder left behind)."""
    try:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
    except (OSError, OverflowError, UnicodeError) as exc:
        raise ValueError(f"--ip {ip}: the controller cannot listen there ({getattr(exc, 'strerror', None) or exc}); "
                         "use 127.0.0.1 (ranks on this host), 0.0.0.0 (every interface) or an address of this "
                         "host") from None

class Pool:
    """A running set of ranks.  Create with :meth:`Pool.start`; the requests (``run``, ``push``, ``pull``,
    ``run_script``, ``debug``) are :class:`~mnb.controller.requests.Requests`', which the pool composes."""

    def __init__(self, spec: LaunchSpec, bind_ip: str, start_timeout_s: float, cell_timeout_s: float | None,
                 grace_s: float = DEFAULT_GRACE_S, owns_workdir: bool = False, standby_on: bool = False):
        self.spec = spec
        self.bind_ip = bind_ip
        self._gate = RequestGate()
        self._repair = Repair(spec, bind_ip=bind_ip, start_timeout_s=start_timeout_s, make_launcher=make_launcher,
                              standby_on=standby_on)
        self._requests = Requests(spec, self._gate, self._repair, cell_timeout_s=cell_timeout_s, grace_s=grace_s)
        self.standby_choice = "on" if standby_on else "off"
        """``standby=`` as resolved, with what ``auto`` chose and why (the start line says it)."""
        self._owns_workdir = owns_workdir
        self.environ_at_start = dict(os.environ)
        """The kernel's environment the ranks inherited (``kernel_context`` sends what changed since)."""

    run = _request("run")
    run_script = _request("run_script")
    push = _request("push")
    pull = _request("pull")
    debug = _request("debug")
    layout = _requests_state("layout")
    cell_timeout_s = _requests_state("cell_timeout_s")
    grace_s = _requests_state("grace_s")
    event_handlers = _requests_state("event_handlers")
    last_cell_records = _requests_state("last_cell_records")
    last_cell_profile = _requests_state("last_cell_profile")
    last_failure = _requests_state("last_failure")

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
        standby: str = "auto",
    ) -> "Pool":
        """Validate the request, launch torchrun and wait until every rank said hello.

        With ``slurm`` (a :class:`~mnb.controller.slurm.SlurmRequest`) the ranks run as one Slurm
        job of ``slurm.nodes`` nodes instead (``nproc`` is then per node; ``nnodes`` and
        ``rdzv_endpoint`` come from the allocation).

        ``standby`` (``off``/``on``/``auto``): keep the next generation launched ahead, imports
        done, so restarts adopt it (:mod:`mnb.controller.standby`; auto: on for CUDA pools, for
        CPU pools only with cores and memory to spare).
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
        check_seconds(timeout, "timeout")
        _check_bind_ip(bind_ip)
        if cell_timeout is not None:
            check_seconds(cell_timeout, "cell_timeout")
        check_seconds(grace, "grace", zero_ok=True)
        standby_on, standby_choice = standbys.choose(standby, device, nproc,
                                                     several_hosts=nnodes > 1 or slurm is not None)
        if nnodes > 1 and not rdzv_endpoint and slurm is None:
            rdzv_endpoint = f"{socket.gethostname()}:29400"
        work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="mnb-pool-"))
        work.mkdir(parents=True, exist_ok=True)
        spec = launch_spec(nproc, device, work, gpus=gpus, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
                           threads_per_rank=threads_per_rank, bind_ip=bind_ip, extra_env=extra_env, slurm=slurm)
        pool = cls(spec, bind_ip, timeout, cell_timeout, grace_s=grace, owns_workdir=owns, standby_on=standby_on)
        pool.standby_choice = standby_choice
        # a standby kept by %mnb stop in this kernel: adopted when its settings match and standby
        # is on, else discarded (start_note says why)
        pool._repair.standby = standbys.unpark()
        try:
            pool._repair.launch()
        except BaseException:
            pool._remove_files(keep_logs=True)  # the error names the log: it must still be there to read
            raise
        _POOLS.add(pool)
        return pool

    def stop(self) -> None:
        """Shut ranks down, end every process the pool started, remove its folder and secret.

        A request another thread runs (``mnb.train`` in a thread, a widget's run) is
        cancelled and waited for (at most ``STOP_REQUEST_WAIT_S``): it raises PoolError
        saying the pool was stopped.  Nothing relaunches a stopped pool.
        """
        self._repair.stop()
        with self._gate.taken_over("stop", "the pool was stopped (Pool.stop, %mnb stop) while this request ran",
                                   STOP_REQUEST_WAIT_S):
            generation = self._repair.generation
            if generation is not None and not generation.closed:
                for rank, info in generation.ranks.items():
                    if info.state == "idle":
                        generation.transport.send(rank, Message("shutdown", header={}))
                deadline = time.monotonic() + SHUTDOWN_WAIT_S
                while generation.launcher.returncode() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                generation.close()
        standbys.park(self._repair.take_standby())  # %mnb start in this kernel may adopt it
        self._remove_files()

    def restart(self, *, layout: ParallelConfig | None = None) -> "Pool":
        """Stop every process and start the same pool again (same size, device, GPUs), in the same
        layout, as an automatic restart keeps it (``layout``: another one, e.g. ``ParallelConfig()``
        for the default); names defined in earlier cells are gone.

        As :meth:`stop`, a request another thread runs is cancelled and waited for first.  A stopped
        pool is never relaunched: its restart raises :class:`PoolError` saying to start a new one.
        """
        if self._repair.stopped:
            raise PoolError(f"{STOPPED}; {STOPPED_NEXT}")
        target = (self.layout if layout is None else layout).resolve(self.world_size)  # ValueError: not this size
        self._repair.stop()
        with self._gate.taken_over("restart", "the pool was restarted (%mnb restart) while this request ran",
                                   STOP_REQUEST_WAIT_S):
            if self._repair.generation is not None:
                self._repair.generation.close()
            self.layout = target  # what status shows meanwhile: the layout the new ranks will have
            self._repair.launch(target)
        return self

    def _remove_files(self, *, keep_logs: bool = False) -> None:
        """The connection file holds the pool's secret: remove it, and the folder mnb made (``keep_logs``: a
        start that failed keeps the folder with its logs, which its error names, and loses only the secret)."""
        if self._owns_workdir and not keep_logs:
            shutil.rmtree(self.workdir(), ignore_errors=True)
        else:
            for path in (self.spec.connection_file, self.spec.connection_file.with_name("pool.json.tmp")):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    # ------------------------------------------------------------ what the pool is now
    @property
    def ranks(self) -> dict[int, RankInfo]:
        """The current generation's rank table (rank -> pid, host, state, coordinates); replaced, never resized."""
        return self._repair.ranks

    @property
    def _transport(self) -> Transport | None:
        return self._repair.transport

    @property
    def _launcher(self) -> Launcher | None:
        generation = self._repair.generation
        return generation.launcher if generation is not None else None

    @property
    def start_timeout_s(self) -> float:
        """How long a start (and a restart, and a script's restoring of the layout) may take."""
        return self._repair.start_timeout_s

    @property
    def restarts(self) -> int:
        """How many times the pool replaced its processes on its own."""
        return self._repair.restarts

    @property
    def startup_s(self) -> float | None:
        generation = self._repair.generation
        return generation.startup_s if generation is not None else None

    @property
    def start_timings(self) -> str | None:
        """Where the last start's seconds went, for the rank ready last (``%mnb start --timings``)."""
        generation = self._repair.generation
        return generation.start_timings if generation is not None else None

    @property
    def restarting(self) -> bool:
        return self._repair.restarting

    @property
    def start_note(self) -> str:
        """What the last start or restart did about a standby: adopted it, or launched cold and why."""
        return self._repair.start_note

    def standby_status(self) -> dict[str, Any] | None:
        """The standby (None when there is none): state, rank pids, torchrun pid, host memory (RSS bytes)."""
        standby = self._repair.standby
        return standby.status() if standby is not None else None

    @property
    def running(self) -> bool:
        return self.restarting or (self._transport is not None and self._repair.broken is None)

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

    def status(self) -> list[dict[str, Any]]:
        """Per rank: pid, host, state, device, memory in use, layout, torch and megatron-core versions.

        Answered by each rank's I/O thread, also while a cell or a background run holds
        the pool; a rank that died while no request ran starts the automatic restart here;
        during an automatic restart, by the restart's own progress (each rank
        ``restarting: launched``, ``ready`` once its hello arrived, then the layout's
        restoring).  A rank still finishing its start after its hello says what it does
        (``idle: importing Megatron-Core, 3.1 s so far``; a cell waits for it).  Reads no queue a
        request or a restart waits on.
        """
        rows = self._repair.rows(self.layout)
        if rows is None and not self._gate.holder and self._repair.replace_if_dead(self.layout):
            rows = self._repair.rows(self.layout)  # a rank died between requests: the restart began just now
        if rows is not None:
            return rows
        ranks, transport, layout = self.ranks, self._transport, self.layout
        alive = [r for r, i in ranks.items() if i.state != "dead"]
        answers = transport.ask("status", alive, ASK_TIMEOUT_S) if transport is not None and alive else {}
        quiet = not self._gate.holder  # no request runs: a rank still marked busy answered late
        rows = []
        for rank, info in sorted(ranks.items()):
            reply = answers.get(rank)
            state = info.state
            if reply is not None and state in ("idle", "busy"):
                state = "busy" if reply.get("busy") or (state == "busy" and not quiet) else "idle"
            if reply is None and state != "dead":
                state = f"{state} (no answer)"
            elif reply is not None and reply.get("starting"):  # its start goes on after the hello; cells wait
                state = f"{state}: {reply['starting']}"
            rows.append({
                "rank": rank, "pid": info.pid, "host": info.host, "state": state, "device": info.device,
                "memory_bytes": reply.get("memory_bytes") if reply else None,
                "layout": layout.describe(), "coords": info.label(layout.as_dict()),
                "torch": info.torch_version, "megatron": info.megatron_version,
            })
        return rows

    def stacks(self, ranks: Iterable[int] | None = None) -> dict[int, str]:
        """Each rank's current Python stack (main thread), e.g. to see where a cell hangs.

        Answered by each rank's I/O thread, also while another request runs.
        """
        return {r: m.get("stacks", "") for r, m in self._ask_stacks(ranks).items()}

    def collectives(self, ranks: Iterable[int] | None = None) -> dict[int, dict | None]:
        """Each rank's read-out of its collectives, what ``%mnb stacks`` diagnoses hangs from:
        ``{"source": "flight recorder" | "mnb", "groups": [{"name": "tp", "ranks": [0, 1], "calls": 43,
        "pending": [{"op": "all_reduce", "seq": 43, ...}], ...}]}`` (NCCL ranks read torch's Flight
        Recorder, gloo ranks mnb's own count; calls count from the start of the rank's current cell), or
        None from a rank that has none yet.  Answered like :meth:`stacks`, also while another request runs.
        """
        return {r: m.get("collectives") for r, m in self._ask_stacks(ranks).items()}

    def stacks_report(self, ranks: Iterable[int] | None = None) -> Text:
        """What ``%mnb stacks`` prints: each rank's stack and the collective it is in, then the diagnosis
        across every rank (``rank 1 is at all_reduce #42 of tp group [0,1]; rank 0 is at #43 — ...``)."""
        answers = self._ask_stacks(None)  # every rank's counts, for the diagnosis
        shown = [r for r in answers if ranks is None or r in set(ranks)]
        labels = self._requests.labels()
        blocks = [f"--- rank {r} ({labels.get(r, f'r{r}')}) ---\n{answers[r].get('stacks', '')}"
                  + "".join(f"in {text}\n" for text in hangs.waiting_in(answers[r].get("collectives")))
                  for r in shown]
        return Text("\n".join(blocks + hangs.diagnose({r: m.get("collectives") for r, m in answers.items()})))

    def _ask_stacks(self, ranks: Iterable[int] | None) -> dict[int, Message]:
        transport, table = self._transport, self.ranks
        if transport is None or self.restarting:
            return {}
        targets = [r for r in (ranks if ranks is not None else table) if r in table and table[r].state != "dead"]
        return dict(sorted(transport.ask("stacks", targets, ASK_TIMEOUT_S).items()))

    @property
    def state(self) -> str:
        """'running', 'restarting', 'stopped', or why the pool is broken."""
        return "restarting" if self.restarting else "running" if self.running else (self._repair.broken or "stopped")

    def __repr__(self) -> str:
        return f"<mnb.Pool {self.world_size} x {self.spec.device} ranks, {self.layout.describe()}, {self.state}>"


@atexit.register
def _stop_all() -> None:
    for pool in list(_POOLS):
        try:
            pool._repair.stop()
            standby = pool._repair.take_standby()
            if standby is not None:
                standby.close()
            if pool._repair.generation is not None:
                pool._repair.generation.close(grace_s=EXIT_TEARDOWN_GRACE_S)
            pool._remove_files()
        except Exception as exc:  # interpreter is exiting; say what could not be cleaned
            log.warning("could not stop %r: %s", pool, exc)
