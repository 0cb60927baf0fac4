"""A real one-node Slurm cluster on localhost, for the tests (and by hand).

    python -m tests.slurm_local start /tmp/mnb-slurm     # prints: export SLURM_CONF=/tmp/mnb-slurm/slurm.conf
    SLURM_CONF=/tmp/mnb-slurm/slurm.conf sinfo
    python -m tests.slurm_local stop /tmp/mnb-slurm

Debian's ``slurm-wlm`` and ``munge`` (installed by scripts/setup.sh, never by a test):
a private munged (its own key and socket), slurmctld and slurmd, all as root, with a
configuration in the given folder that nothing else reads (clients find it through
``SLURM_CONF``).  One node, this host, with the CPUs asked for and as many GPU
"slots" (GRES backed by /dev/null-like files, so ``--gpus-per-node`` passes
``sbatch --test-only``; nothing here has a GPU).  Ports are picked free at start.
No cgroups, no accounting: proctrack/linuxproc tracks job processes by parentage.

:func:`unavailable` says why Slurm cannot run here (not installed, not root), so tests
skip with that reason instead of failing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "squeue", "sinfo")
_FAKE_GPU_FILES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def unavailable() -> str | None:
    """Why a local Slurm cannot be started here, or None when it can."""
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None
               and not Path("/usr/sbin", name).exists()]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): scripts/setup.sh --for tests installs Debian's "
                "slurm-wlm and munge with apt-get")
    if os.geteuid() != 0:
        return "the local Slurm runs slurmd, which starts jobs, as root: run the tests as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class LocalSlurm:
    root: Path
    cpus: int = 2
    gpus: int = 2

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        root, node = self.root, socket.gethostname().split(".")[0]
        for sub in ("state", "spool", "log", "munge"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o700)
        key = root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(128))
            key.chmod(0o600)
        gpus = min(self.gpus, len(_FAKE_GPU_FILES))
        self.conf.write_text("\n".join([
            "ClusterName=mnbtest",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
            "MpiDefault=none", "ReturnToService=2", "KillWait=5", "SlurmdTimeout=30", "InactiveLimit=0",
            "GresTypes=gpu",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={self.cpus} Gres=gpu:{gpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")
        (root / "gres.conf").write_text("AutoDetect=off\n" + "".join(
            f"NodeName={node} Name=gpu File={f}\n" for f in _FAKE_GPU_FILES[:gpus]))

    def start(self, timeout_s: float = 30.0) -> "LocalSlurm":
        """Start munged, slurmctld and slurmd; return once the node is idle (or raise saying why)."""
        why = unavailable()
        if why:
            raise RuntimeError(why)
        self.stop()
        self.write_config()
        root, conf = self.root, str(self.conf)
        munge = root / "munge"
        steps = [
            [_binary("munged"), "--force", f"--socket={munge / 'munge.socket'}", f"--key-file={munge / 'munge.key'}",
             f"--pid-file={munge / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
             f"--seed-file={munge / 'munged.seed'}"],
            [_binary("slurmctld"), "-f", conf],
            [_binary("slurmd"), "-f", conf],
        ]
        env = {**os.environ, **self.env}
        for command in steps:  # each daemonises itself and writes its pid file
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
            if done.returncode != 0:
                raise RuntimeError(f"{Path(command[0]).name} did not start: {done.stderr.strip()}\n{self.logs()}")
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env, timeout=30)
            state = out.stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return self
            time.sleep(0.3)
        raise RuntimeError(f"the local Slurm node is {state or 'not known'} after {timeout_s:.0f} s\n{self.logs()}")

    def pids(self) -> list[int]:
        found = []
        for path in (self.root / "slurmd.pid", self.root / "slurmctld.pid", self.root / "munge" / "munged.pid"):
            try:
                found.append(int(path.read_text().strip()))
            except (OSError, ValueError):
                pass
        return found

    def stop(self) -> None:
        """End the daemons this folder's pid files name (slurmd first), waiting for each."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        for path in (self.root / "slurmd.pid", self.root / "slurmctld.pid", self.root / "munge" / "munged.pid"):
            path.unlink(missing_ok=True)

    def logs(self, lines: int = 15) -> str:
        texts = []
        for path in sorted((self.root / "log").glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            texts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(texts)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__)
        return 2
    cluster = LocalSlurm(Path(argv[1]).resolve())
    if argv[0] == "start":
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
