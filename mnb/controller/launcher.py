"""Start and stop the torchrun process tree that holds the ranks.

torchrun is started in a new session (its own process group), so Jupyter's
interrupt, which signals the kernel's process group, never reaches it: the
controller forwards interrupts to ranks as messages instead.  torchrun in
turn starts each rank in a session of its own, and whatever a rank starts
(Megatron's checkpoint writers, a user's subprocess) inherits that rank's
process group.  Stopping therefore signals the torchrun tree, each rank PID
the ranks reported in their hello, and every process still in one of the
ranks' process groups, also those whose rank already died and that were
re-parented to init (each checked against its start time, so a reused PID
is never hit).  Processes are never looked up or signalled by name.

torchrun runs through :mod:`mnb.worker.agent`: on one host its unauthenticated
stores listen on 127.0.0.1 only (``--loopback-stores``), and gloo/NCCL bootstrap on
the loopback interface; on every host it records how failed ranks ended.

How a rank ended: its exit status read from ``/proc/PID/stat`` while it is a
zombie (before torchrun reaps it), else torchrun's own record of the failure,
written by the agent as JSON into ``LaunchSpec.exits_dir`` (exit code or signal,
pid), else, when torchrun saw no failure although the rank is gone, exit code 0.
Nothing is parsed from torchrun's log text.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from mnb.paths import cache_dir
from mnb.protocol import EXITS_DIR_ENV, fault_file
from mnb.timeouts import DEATH_REPORT_WAIT_S, TEARDOWN_GRACE_S

log = logging.getLogger(__name__)



@dataclass
class LaunchSpec:
    """Everything needed to (re)start the same torchrun pool."""

    nproc_per_node: int
    device: str  # "cpu" | "cuda"
    connection_file: Path
    log_file: Path
    gpus: list[int] | None = None
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    threads_per_rank: int | None = None
    loopback: bool = True
    """One host, controller on 127.0.0.1: torchrun's stores and gloo/NCCL stay on loopback."""
    extra_env: dict[str, str] = field(default_factory=dict)
    slurm: Any = None
    """A :class:`mnb.controller.slurm.SlurmRequest`: the ranks run as one Slurm job (``%mnb start --slurm``)."""

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def exits_dir(self) -> Path:
        """Where torchrun's agents record how failed ranks ended (mnb.worker.agent), in the pool's folder."""
        return self.log_file.parent / "exits"

    def command(self) -> list[str]:
        single_host = self.nnodes == 1 and self.rdzv_endpoint is None
        cmd = [sys.executable, "-m", "mnb.worker.agent"]
        if single_host and self.loopback:
            cmd.append("--loopback-stores")
        cmd.append(f"--nproc-per-node={self.nproc_per_node}")
        if single_host:
            cmd.append("--standalone")
            if self.loopback:
                cmd.append("--local-addr=127.0.0.1")
        else:
            cmd += [
                f"--nnodes={self.nnodes}",
                "--node-rank=0",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.rdzv_endpoint}",
            ]
        # torchrun's own log folder goes into the pool's folder, removed with it (not /tmp/torchelastic_*)
        cmd += ["--max-restarts=0", "--monitor-interval=0.1", f"--log-dir={self.log_file.parent / 'torchelastic'}"]
        cmd += ["-m", "mnb.worker", "--connect", str(self.connection_file), "--device", self.device]
        return cmd

    def remote_command(self, node_rank: str = "N") -> str:
        """What to run on another host so it joins this pool."""
        return (
            f"torchrun --nnodes={self.nnodes} --node-rank={node_rank} "
            f"--nproc-per-node={self.nproc_per_node} --rdzv-backend=c10d "
            f"--rdzv-endpoint={self.rdzv_endpoint} -m mnb.worker "
            f"--connect {self.connection_file} --device {self.device}"
        )

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env["PYTHONUNBUFFERED"] = "1"
        env["MNB_DEVICE"] = self.device
        env["MPLBACKEND"] = "Agg"  # ranks render figures to PNG for the notebook
        env[EXITS_DIR_ENV] = str(self.exits_dir)
        threads = self.threads_per_rank or max(1, (os.cpu_count() or 2) // self.nproc_per_node)
        env.setdefault("OMP_NUM_THREADS", str(threads))
        if self.device == "cuda":
            # Megatron's own launch scripts set this so TP communication can overlap compute.
            env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
            # Compiled fused kernels outlive the pool: a later pool on this machine loads them
            # (about 3 s instead of 11 s on an H200); a user's own setting wins.
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(COMPILE_CACHE / "inductor"))
            env.setdefault("TRITON_CACHE_DIR", str(COMPILE_CACHE / "triton"))
            # PyTorch's Flight Recorder: the NCCL calls each rank is in, for hang reports
            # (mnb.megatron.collectives reads it; gloo ranks count their calls themselves).
            # torch 2.11 reads TORCH_FR_BUFFER_SIZE and calls the older name deprecated.
            if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
                env.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
        if self.loopback and self.nnodes == 1:
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus)
        # The workers need mnb importable exactly as the kernel has it.  A wheel in one
        # of this interpreter's site folders is found there by the ranks too (putting
        # that folder on PYTHONPATH would move it ahead of the standard library); a
        # checkout (editable install, or only on the kernel's sys.path) is added.
        package_root = _package_root()
        if package_root is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        return env


def _package_root() -> str | None:
    """The folder holding the ``mnb`` package, unless it is one of this interpreter's site folders."""
    root = Path(__file__).resolve().parents[2]
    sites = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        sites.append(site.getusersitepackages())
    if any(Path(s).resolve() == root for s in sites if s):
        return None
    return str(root)


class Launcher:
    """One torchrun process tree."""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.process: subprocess.Popen | None = None
        self.started_at = 0.0
        # Replaced, never changed in place: a background restart adopts ranks while a stop walks them.
        self._rank_processes: dict[int, psutil.Process] = {}
        self._rank_groups: frozenset[int] = frozenset()
        self._exit_status: dict[int, str] = {}

    def start(self) -> None:
        self.spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.forget_exits()
        log_handle = open(self.spec.log_file, "ab")
        self.started_at = time.time() - 1.0  # psutil's create_time has ~10 ms resolution
        try:
            self.process = subprocess.Popen(
                self.spec.command(),
                stdin=subprocess.DEVNULL,
                stdout=log_handle,
                stderr=subprocess.STDOUT,
                env=self.spec.environment(),
                start_new_session=True,
            )
        finally:
            log_handle.close()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def adopt(self, rank: int, pid: int, local: bool) -> None:
        """Remember a rank's process (from its hello) so it can be watched and stopped."""
        if not local:
            return
        try:
            process = psutil.Process(pid)
        except psutil.NoSuchProcess:
            return
        self._rank_processes = {**self._rank_processes, rank: process}
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            return
        if group not in (os.getpgid(0), 0, 1):
            self._rank_groups = self._rank_groups | {group}

    def dead_ranks(self) -> list[int]:
        """Local ranks whose process has exited (zombie or gone); their exit status is kept."""
        dead = []
        for rank, proc in self._rank_processes.items():
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    continue
                status = _zombie_exit_status(proc.pid)
                if status is not None:
                    self._exit_status.setdefault(rank, status)
            except psutil.NoSuchProcess:
                pass
            dead.append(rank)
        return dead

    def deaths(self, wait_s: float = DEATH_REPORT_WAIT_S) -> dict[int, str]:
        """How each dead local rank ended: ``{rank: "exit code 3 (pid 123)"}``.

        Waits up to ``wait_s`` for torchrun to record the failure (it tears
        down the other ranks after a non-zero exit).  A rank that is gone while
        torchrun saw no failure exited with code 0.
        """
        dead = set(self.dead_ranks())
        deadline = time.monotonic() + wait_s
        while self.returncode() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            dead |= set(self.dead_ranks())
        summary = self.failures()
        described: dict[int, str] = {}
        for rank in sorted(dead | set(summary)):
            pid = self._rank_processes[rank].pid if rank in self._rank_processes else None
            if rank in self._exit_status:
                described[rank] = self._exit_status[rank] + (f" (pid {pid})" if pid else "")
            elif rank in summary:
                described[rank] = summary[rank]
            elif self.returncode() is None:
                described[rank] = "exit code 0" + (f" (pid {pid})" if pid else "")
            else:
                described[rank] = "exited"
        return described

    def forget_exits(self) -> None:
        """Remove what an earlier launch in the same folder recorded (a restart starts clean)."""
        shutil.rmtree(self.spec.exits_dir, ignore_errors=True)

    def failures(self) -> dict[int, str]:
        """How ranks died, as torchrun recorded it (mnb.worker.agent): ``{rank: 'exit code 3 (pid 123)'}``."""
        found: dict[int, str] = {}
        for path in sorted(self.spec.exits_dir.glob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            for rank, failure in data.items():
                found[int(rank)] = describe_exit(int(failure["exitcode"])) + f" (pid {failure['pid']})"
        return found

    def fault_report(self, rank: int) -> tuple[Path, str]:
        """(path, text) of what ``rank``'s fault handler wrote when a signal killed it (mnb.worker.faults),
        copied beside the pool's log where the restart leaves it; empty text when it wrote nothing (a
        SIGKILL, a remote host's rank)."""
        try:
            text = fault_file(self.spec.exits_dir, rank).read_text(errors="replace")
        except OSError:
            return Path(), ""
        kept = self.spec.log_file.parent / f"crash-rank{rank}.txt"  # the exits folder is emptied at the restart
        try:
            kept.write_text(text)
        except OSError:
            pass
        return kept, text

    def describe(self) -> str | None:
        """A line on how the ranks were launched, where there is more to say than the rank table."""
        return None

    def not_ready_error(self, ready: int, world: int, timeout_s: float) -> str:
        """What the notebook is told when only ``ready`` of ``world`` ranks joined within ``timeout_s``."""
        tail = self.log_tail()
        return (f"only {ready} of {world} ranks were ready after {timeout_s:.3g} s; raise --timeout, or read the "
                f"log {self.spec.log_file}" + (f":\n{tail}" if tail.strip() else
                                               " (empty so far: torchrun had not started the ranks)"))

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.spec.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def descendants(self) -> list[psutil.Process]:
        """Every live process of this pool: torchrun's tree, the ranks, and what the ranks started.

        Processes a rank started stay in its process group even after the rank
        died and they were re-parented to init; those created before this
        launcher started are never included.
        """
        found: dict[int, psutil.Process] = {}
        if self.process is not None:
            try:
                root = psutil.Process(self.process.pid)
                for proc in [root, *root.children(recursive=True)]:
                    found[proc.pid] = proc
            except psutil.NoSuchProcess:
                pass
        for proc in self._rank_processes.values():
            found.setdefault(proc.pid, proc)
            try:
                for child in proc.children(recursive=True):
                    found.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass
        if self._rank_groups:
            for proc in psutil.process_iter(["pid", "create_time"]):
                try:
                    if (proc.pid not in found and os.getpgid(proc.pid) in self._rank_groups
                            and proc.info["create_time"] >= self.started_at):
                        found[proc.pid] = proc
                except (ProcessLookupError, psutil.NoSuchProcess):
                    continue
        return [p for p in found.values() if _running(p)]

    def stop(self, grace_s: float = TEARDOWN_GRACE_S) -> None:
        """SIGTERM every process of the pool, then SIGKILL what is left after ``grace_s`` (0: at once)."""
        alive = self.descendants()
        if self.process is not None and self.process.poll() is None and grace_s > 0:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in alive:
            _signal(proc, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        _, alive = psutil.wait_procs(alive, timeout=max(grace_s, 0.5))
        alive += [p for p in self.descendants() if p not in alive]  # started while we were stopping
        for proc in alive:
            _signal(proc, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=2)
        if self.process is not None:
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                log.warning("torchrun (pid %d) did not exit after SIGKILL", self.process.pid)
        self._rank_processes = {}

    def all_pids(self) -> list[int]:
        pids = [p.pid for p in self._rank_processes.values()]
        if self.process is not None:
            pids.append(self.process.pid)
        return pids


def reachable_address(address: str) -> str:
    """The address ranks connect to: a wildcard bind (``tcp://0.0.0.0:PORT``) names this host instead.

    A rank on another host that connected to 0.0.0.0 would reach itself, not the controller.
    """
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if host in ("0.0.0.0", "*", "::", "[::]"):
        return f"tcp://{socket.gethostname()}:{port}"
    return address


def _zombie_exit_status(pid: int) -> str | None:
    """A zombie's exit status from /proc/PID/stat (field 52, Linux >= 3.5), before it is reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = int(stat[stat.rindex(")") + 2:].split()[49])
    except (OSError, ValueError, IndexError):
        return None
    if status & 0x7F:
        return describe_exit(-(status & 0x7F))
    return describe_exit((status >> 8) & 0xFF)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)  # psutil checks the PID still names the same process
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


COMPILE_CACHE = cache_dir()
"""Where CUDA ranks keep Inductor's and Triton's compiled kernels (``%mnb start`` docs say so):
mnb's one cache folder, :func:`mnb.paths.cache_dir`."""

FLIGHT_RECORDER_ENTRIES = 2000
"""``TORCH_FR_BUFFER_SIZE`` of CUDA pools (a user's own setting, or ``TORCH_NCCL_TRACE_BUFFER_SIZE``, wins):
the calls each rank's Flight Recorder keeps."""
