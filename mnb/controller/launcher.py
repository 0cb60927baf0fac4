"""Start and stop the torchrun process tree that holds the ranks.

torchrun is started in a new session (its own process group), so Jupyter's
interrupt, which signals the kernel's process group, never reaches it: the
controller forwards interrupts to ranks as messages instead.  torchrun in
turn starts each rank in a session of its own, so stopping signals the
torchrun process group *and* each rank PID the ranks reported in their hello
(checked against the process's start time so a reused PID is never hit).
Processes are never looked up or signalled by name.

torchrun's own summary of a failed rank ("exitcode : -11 (pid: 123)") is
parsed from its log to say how a rank died.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

_FAILURE = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)[^\n]*\n\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)"
)


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
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.nproc_per_node}"]
        if self.nnodes == 1 and self.rdzv_endpoint is None:
            cmd.append("--standalone")
        else:
            cmd += [
                f"--nnodes={self.nnodes}",
                "--node-rank=0",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.rdzv_endpoint}",
            ]
        cmd += ["--max-restarts=0", "--monitor-interval=0.1"]
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
        threads = self.threads_per_rank or max(1, (os.cpu_count() or 2) // self.nproc_per_node)
        env.setdefault("OMP_NUM_THREADS", str(threads))
        if self.device == "cuda":
            # Megatron's own launch scripts set this so TP communication can overlap compute.
            env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus)
        # The workers need mnb importable exactly as the kernel has it.
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        return env


class Launcher:
    """One torchrun process tree."""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.process: subprocess.Popen | None = None
        self._rank_processes: dict[int, psutil.Process] = {}

    def start(self) -> None:
        self.spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        log_handle = open(self.spec.log_file, "ab")
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
            self._rank_processes[rank] = psutil.Process(pid)
        except psutil.NoSuchProcess:
            pass

    def dead_ranks(self) -> list[int]:
        """Local ranks whose process has exited (zombie or gone)."""
        dead = []
        for rank, proc in self._rank_processes.items():
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    dead.append(rank)
            except psutil.NoSuchProcess:
                dead.append(rank)
        return dead

    def failures(self) -> dict[int, str]:
        """How ranks died, from torchrun's failure summary: {rank: 'exit code 3'}."""
        try:
            text = self.spec.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return {}
        found: dict[int, str] = {}
        for match in _FAILURE.finditer(text):
            code = int(match["code"])
            found[int(match["rank"])] = describe_exit(code) + f" (pid {match['pid']})"
        return found

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.spec.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the tree we started, then SIGKILL what is left after ``grace_s``."""
        procs: list[psutil.Process] = []
        if self.process is not None and self.process.poll() is None:
            try:
                root = psutil.Process(self.process.pid)
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                procs = []
        for proc in self._rank_processes.values():
            if proc not in procs:
                procs.append(proc)
        alive = [p for p in procs if _running(p)]
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in alive:
            _signal(proc, signal.SIGTERM)
        _, alive = psutil.wait_procs(alive, timeout=grace_s)
        for proc in alive:
            _signal(proc, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=2)
        if self.process is not None:
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                log.warning("torchrun (pid %d) did not exit after SIGKILL", self.process.pid)
        self._rank_processes.clear()

    def all_pids(self) -> list[int]:
        pids = [p.pid for p in self._rank_processes.values()]
        if self.process is not None:
            pids.append(self.process.pid)
        return pids


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


def visible_gpu_count() -> int:
    """GPUs the workers would see, without importing torch in the kernel."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        physical = len([line for line in out.stdout.splitlines() if line.strip()]) if out.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired):
        physical = 0
    if env is not None and physical:
        ids = [x for x in env.split(",") if x.strip() and x.strip() != "-1"]
        return min(len(ids), physical)
    return physical


def resolve_device(device: str, nproc: int | None, gpus: list[int] | None) -> tuple[str, int]:
    """Check --device/-n/--gpus against what this machine has; return (device, nproc)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
    if nproc is not None and nproc < 1:
        raise ValueError(f"-n must be at least 1, got {nproc}")
    visible = visible_gpu_count() if (device != "cpu" or gpus) else 0
    if gpus is not None:
        if device == "cpu":
            raise ValueError("--gpus was given with --device cpu; drop one of them")
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"--gpus lists a GPU twice: {gpus}")
        unknown = [g for g in gpus if g < 0 or g >= visible]
        if unknown:
            raise ValueError(
                f"unknown GPU id(s) {unknown}: this machine shows {visible} GPU(s)"
                + (f" (ids 0-{visible - 1})" if visible else "")
            )
        device = "cuda"
        if nproc is None:
            nproc = len(gpus)
        elif nproc != len(gpus):
            raise ValueError(f"-n {nproc} does not match the {len(gpus)} GPU(s) given by --gpus {gpus}")
        return device, nproc
    if device == "auto":
        device = "cuda" if visible else "cpu"
    if device == "cuda":
        if not visible:
            raise ValueError("--device cuda but no GPU is visible here (nvidia-smi found none); use --device cpu")
        nproc = visible if nproc is None else nproc
        if nproc > visible:
            raise ValueError(f"-n {nproc} is larger than the {visible} visible GPU(s); use -n {visible} or fewer")
        return device, nproc
    return "cpu", 2 if nproc is None else nproc
