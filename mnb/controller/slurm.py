"""A pool on a Slurm allocation: one job whose tasks run torchrun, ranks joining the notebook.

    %mnb start --slurm --nodes 2 --gpus-per-node 8 --partition gpu --time 2:00:00 --ip 0.0.0.0

submits one job (``templates/launch/pool.sbatch``): one task per node, each running
``torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d`` on the allocation's
first node, whose workers run ``python -m mnb.worker --connect FILE`` and join the
notebook's controller exactly as ranks joining by hand do (docs/several-machines.md).
Slurm, not mnb, chooses the nodes; the ranks report their hosts in their hello.

Why the pieces are as they are:

- The connection file (and the job's output) live in a folder the nodes must read:
  ``$MNB_SLURM_DIR``, else ``~/.mnb/pools/`` (home directories are shared on most
  clusters), mode 0700, removed with the pool.
- The controller binds ``--ip``; on 127.0.0.1 only ranks on this host can reach it,
  which mnb says when it submits.
- The job ends with the pool: ``stop``/``restart``/kernel shutdown run ``scancel``
  (through :meth:`SlurmLauncher.stop`), and a watcher process started in its own
  session cancels the job when the kernel is killed (no atexit runs then), also
  while the job still waits in the queue.  A job still pending at ``--timeout`` is
  cancelled and reported with Slurm's pending reason.
- Slurm is asked with its own commands (``sbatch --parsable``, ``scontrol show job
  -o``, ``scancel``), never by name or by guessing PIDs on other hosts.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from mnb.controller.launcher import LaunchSpec, Launcher
from mnb.errors import PoolError
from mnb.launch_templates import render_template

log = logging.getLogger(__name__)

ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                 "RESIZING", "SIGNALING", "STAGE_OUT"}
"""Job states (``scontrol show job``) in which the pool's job still holds or waits for nodes."""
STATE_POLL_S = 1.0
"""How often the controller asks Slurm for the job's state at most (the pool asks every 0.1 s)."""
CANCEL_WAIT_S = 60.0
"""How long ``stop`` waits for a cancelled job to leave the queue (Slurm's KillWait is 30 s by default)."""
WATCH_INTERVAL_S = 1.0
"""How often the watcher checks that the notebook kernel is alive."""
_TOKEN = re.compile(r"(\w+)=(\S*)")


@dataclass(frozen=True, kw_only=True)
class SlurmRequest:
    """What ``%mnb start --slurm`` asks Slurm for."""

    nodes: int = 1
    gpus_per_node: int | None = None
    """GPUs (and ranks) per node; None for CPU ranks (``-n`` per node)."""
    partition: str | None = None
    time: str | None = None
    """Slurm's time limit (``--time``), e.g. ``2:00:00``."""
    account: str | None = None
    sbatch_args: tuple[str, ...] = ()
    """Further sbatch options, passed as they are (``--sbatch-arg=--qos=debug``)."""
    job_name: str = "mnb-pool"

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"--nodes must be a positive integer, got {self.nodes!r}")
        if self.gpus_per_node is not None and (not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1):
            raise ValueError(f"--gpus-per-node must be a positive integer, got {self.gpus_per_node!r}")

    def resolve(self, device: str, nproc: int | None) -> tuple[str, int]:
        """(device, ranks per node) of the job: GPUs of the nodes, not of this host."""
        if device == "auto":
            device = "cuda" if self.gpus_per_node else "cpu"
        if device == "cuda":
            if not self.gpus_per_node:
                raise ValueError("--slurm --device cuda needs --gpus-per-node G (the ranks per node)")
            if nproc is not None and nproc != self.gpus_per_node:
                raise ValueError(f"-n {nproc} does not match --gpus-per-node {self.gpus_per_node}: with --slurm "
                                 "there is one rank per GPU; drop -n")
            return device, self.gpus_per_node
        if device != "cpu":
            raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
        if self.gpus_per_node:
            raise ValueError("--gpus-per-node was given with --device cpu; CPU ranks per node are -n N")
        nproc = 2 if nproc is None else nproc
        if nproc < 1:
            raise ValueError(f"-n must be at least 1, got {nproc}")
        return device, nproc

    def sbatch_options(self) -> list[str]:
        """Options on sbatch's command line (they take precedence over the script's #SBATCH lines)."""
        options = [f"--{name}={value}" for name, value in
                   (("partition", self.partition), ("time", self.time), ("account", self.account)) if value]
        return options + list(self.sbatch_args)


def require_slurm() -> None:
    """Raise ValueError unless Slurm's client commands are on PATH (they submit and cancel the job)."""
    missing = [c for c in ("sbatch", "scontrol", "scancel") if shutil.which(c) is None]
    if missing:
        raise ValueError(f"--slurm needs Slurm's commands on this host, and {', '.join(missing)} is not on PATH: "
                         "run the notebook on a login node (or a node) of the cluster")


def shared_pool_dir() -> Path:
    """Where pools on Slurm keep their connection file and log: a folder the nodes share."""
    root = Path(os.environ.get("MNB_SLURM_DIR") or Path.home() / ".mnb" / "pools").expanduser()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


@dataclass(frozen=True)
class JobState:
    """One ``scontrol show job -o`` line, the fields mnb reads."""

    state: str
    reason: str
    nodes: str
    exit_code: str

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def returncode(self) -> int:
        """Shell-style: the batch script's exit code, or minus the signal that ended it."""
        code, _, sig = self.exit_code.partition(":")
        if sig.isdigit() and int(sig):
            return -int(sig)
        return int(code) if code.isdigit() else 1


def job_state(job_id: str) -> JobState | None:
    """The job's state from Slurm; None once Slurm no longer knows it (or cannot be asked)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("scontrol show job %s failed: %s", job_id, exc)
        return None
    if out.returncode != 0:
        return None
    fields = dict(_TOKEN.findall(out.stdout))
    if "JobState" not in fields:
        return None
    return JobState(state=fields["JobState"], reason=fields.get("Reason", "None"),
                    nodes=fields.get("NodeList", ""), exit_code=fields.get("ExitCode", "0:0"))


def cancel(job_id: str) -> None:
    """``scancel`` the job (Slurm signals its steps, then kills what is left after KillWait)."""
    try:
        subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("scancel %s failed: %s", job_id, exc)


class SlurmLauncher(Launcher):
    """The pool's ranks as one Slurm job; ranks on this host are also watched by PID like local ones."""

    def __init__(self, spec: LaunchSpec):
        super().__init__(spec)
        if spec.slurm is None:
            raise ValueError("SlurmLauncher needs a LaunchSpec with slurm=SlurmRequest(...)")
        self.request: SlurmRequest = spec.slurm
        self.job_id: str | None = None
        self.script = spec.log_file.with_name("pool.sbatch")
        self._watcher: subprocess.Popen | None = None
        self._state: JobState | None = None
        self._state_at = 0.0
        self._gone = False

    def job_script(self) -> str:
        """The sbatch script of this pool (templates/launch/pool.sbatch)."""
        spec, request = self.spec, self.request
        resources = ([f"#SBATCH --gpus-per-node={request.gpus_per_node}"] if spec.device == "cuda"
                     else [f"#SBATCH --cpus-per-task={spec.nproc_per_node}"])
        return render_template("pool.sbatch", {
            "nodes": request.nodes, "nproc": spec.nproc_per_node, "device": spec.device,
            "controller": f"{socket.gethostname()} (pid {os.getpid()})",
            "connection_file": shlex.quote(str(spec.connection_file)), "log_file": spec.log_file,
            "log_dir": shlex.quote(str(spec.log_file.parent / "torchelastic")), "job_name": request.job_name,
            "python": shlex.quote(sys.executable), "resources": "\n".join(resources),
        })

    def start(self) -> None:
        spec = self.spec
        spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.forget_exits()
        self.script.write_text(self.job_script(), encoding="utf-8")
        env = spec.environment()
        if spec.threads_per_rank is None and "OMP_NUM_THREADS" not in os.environ:
            env.pop("OMP_NUM_THREADS", None)  # this host's cores say nothing of the nodes': the script decides
        command = ["sbatch", "--parsable", *self.request.sbatch_options(), str(self.script)]
        self.started_at = time.time() - 1.0
        try:
            out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PoolError(f"sbatch could not be run ({exc}); is Slurm reachable from this host?") from None
        if out.returncode != 0:
            raise PoolError(f"Slurm refused the pool's job ({shlex.join(command)}):\n{out.stderr.strip()}\n"
                            "change the --partition/--time/--account/--sbatch-arg options it names")
        self.job_id = out.stdout.strip().split(";")[0]
        self._watcher = subprocess.Popen(
            [sys.executable, "-m", "mnb.controller.slurm", "watch", "--pid", str(os.getpid()),
             "--started", repr(psutil.Process().create_time()), "--job", self.job_id],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )
        where = f" in partition {self.request.partition}" if self.request.partition else ""
        print(f"mnb: submitted Slurm job {self.job_id}{where}: {self.request.nodes} node(s) x "
              f"{spec.nproc_per_node} {spec.device} rank(s); waiting for it to start and its ranks to join",
              flush=True)

    def state(self, fresh: bool = False) -> JobState | None:
        """The job's state, asked of Slurm at most every STATE_POLL_S seconds."""
        if self.job_id is None or self._gone:
            return None
        now = time.monotonic()
        if fresh or now - self._state_at >= STATE_POLL_S:
            self._state, self._state_at = job_state(self.job_id), now
            self._gone = self._state is None
        return self._state

    def returncode(self) -> int | None:
        """None while the job waits or runs; its exit code once Slurm says it ended (0 if forgotten)."""
        if self.job_id is None:
            return None
        state = self.state()
        if state is None:
            return 0 if self._gone else None
        return None if state.active else state.returncode()

    def describe(self) -> str:
        state = self.state(fresh=True) if self.job_id else None
        if state is None:
            return f"Slurm job {self.job_id}: no longer known to Slurm"
        text = f"Slurm job {self.job_id}: {state.state}"
        if state.state == "PENDING":
            text += f" (Slurm's reason: {state.reason})"
        elif state.nodes and state.nodes != "(null)":
            text += f" on {state.nodes}"
        return text + (f", partition {self.request.partition}" if self.request.partition else "")

    def log_tail(self, lines: int = 30) -> str:
        head = self.describe() if self.job_id else "no Slurm job was submitted"
        return head + f"; job script {self.script}\n" + super().log_tail(lines)

    def not_ready_error(self, ready: int, world: int, timeout_s: float) -> str:
        state = self.state(fresh=True)
        if state is not None and state.state == "PENDING":
            return (f"Slurm job {self.job_id} was still pending after {timeout_s:.0f} s (Slurm's reason: "
                    f"{state.reason}), so mnb cancelled it; raise --timeout, or ask for what is free "
                    "(fewer --nodes, another --partition, a shorter --time; sinfo shows the nodes)")
        return super().not_ready_error(ready, world, timeout_s)

    def stop(self, grace_s: float = 5.0) -> None:
        """Cancel the job and wait until Slurm has ended it; then end anything of it left on this host."""
        if self.job_id is not None and not self._gone:
            state = self.state(fresh=True)
            if state is not None and (state.active or state.state == "COMPLETING"):
                cancel(self.job_id)
                deadline = time.monotonic() + CANCEL_WAIT_S
                while time.monotonic() < deadline:
                    state = self.state(fresh=True)
                    if state is None or not state.active and state.state != "COMPLETING":
                        break
                    time.sleep(0.2)
                else:
                    log.warning("Slurm job %s still %s %.0f s after scancel", self.job_id, state.state,
                                CANCEL_WAIT_S)
        super().stop(grace_s)
        if self._watcher is not None and self._watcher.poll() is None:
            self._watcher.terminate()
            try:
                self._watcher.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._watcher.kill()


def watch(kernel_pid: int, kernel_started: float, job_id: str) -> int:
    """Cancel ``job_id`` once the notebook kernel is gone; return once the job is.

    Runs in its own session, so neither Jupyter's interrupt nor the kernel's death
    reaches it; it checks the kernel by PID and start time (a reused PID is not the
    kernel) and the job every few seconds.
    """
    checks = 0
    while True:
        if not _alive(kernel_pid, kernel_started):
            cancel(job_id)
            return 0
        checks += 1
        if checks % 5 == 0:
            state = job_state(job_id)
            if state is None or not state.active and state.state != "COMPLETING":
                return 0
        time.sleep(WATCH_INTERVAL_S)


def _alive(pid: int, started: float) -> bool:
    """Process ``pid`` runs (not a zombie) and is the one that began at ``started``."""
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and abs(process.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def main(argv: list[str] | None = None) -> int:
    """``python -m mnb.controller.slurm watch --pid PID --started T --job ID`` (started by the pool)."""
    parser = argparse.ArgumentParser(prog="python -m mnb.controller.slurm")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("watch", help="cancel a pool's Slurm job when its notebook kernel dies")
    w.add_argument("--pid", type=int, required=True)
    w.add_argument("--started", type=float, required=True)
    w.add_argument("--job", required=True)
    args = parser.parse_args(argv)
    return watch(args.pid, args.started, args.job)


if __name__ == "__main__":
    sys.exit(main())
