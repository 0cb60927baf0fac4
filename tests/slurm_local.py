"""A real Slurm cluster on localhost, of one or several nodes, for the tests (and by hand).

    python -m tests.slurm_local start /tmp/mnb-slurm     # prints: export SLURM_CONF=/tmp/mnb-slurm/slurm.conf
    python -m tests.slurm_local start /tmp/mnb-slurm --nodes 2   # two slurmd on this host: nodes n1, n2
    SLURM_CONF=/tmp/mnb-slurm/slurm.conf sinfo
    python -m tests.slurm_local stop /tmp/mnb-slurm

Debian's ``slurm-wlm`` and ``munge`` (installed by scripts/setup.sh, never by a test):
a private munged (its own key and socket), slurmctld and slurmd, all as root, with a
configuration in the given folder that nothing else reads (clients find it through
``SLURM_CONF``).  One node, this host, with the CPUs asked for and as many GPU
"slots" (GRES backed by /dev/null-like files, so ``--gpus-per-node`` passes
``sbatch --test-only``; nothing here has a GPU).  Ports are picked free at start.
No cgroups, no accounting: proctrack/linuxproc tracks job processes by parentage.

``nodes=2`` (or more): as many ``slurmd`` on this host, nodes ``n1``, ``n2``, ... each
``NodeHostname`` this host, ``NodeAddr`` 127.0.0.1 and a port of its own, started as
``slurmd -N n1``; their pid, log and spool files carry the node's name (``%n``).
Debian's slurm-wlm 22.05 runs them (``sinfo`` lists both idle, ``srun -N2 hostname``
prints this host twice, ``SLURMD_NODENAME`` n1 and n2), so a job of ``--nodes 2``
gets two "nodes" whose tasks are processes of this host.

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

from tests.ports import unclaimed_port

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


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class LocalSlurm:
    root: Path
    cpus: int = 2
    """CPUs of each node."""
    gpus: int = 2
    """GPU slots of each node."""
    nodes: int = 1
    """slurmd daemons on this host, one per node (n1, n2, ...); 1: the node is this host's name."""

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    @property
    def node_names(self) -> list[str]:
        if self.nodes == 1:
            return [socket.gethostname().split(".")[0]]
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    def write_config(self) -> None:
        root, host = self.root, socket.gethostname().split(".")[0]
        names = self.node_names
        several = self.nodes > 1
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
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={unclaimed_port()}",
            f"SlurmdPort={unclaimed_port()}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool' / ('%n' if several else '')}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / ('slurmd-%n.pid' if several else 'slurmd.pid')}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / ('slurmd-%n.log' if several else 'slurmd.log')}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
            "MpiDefault=none", "ReturnToService=2", "KillWait=5", "SlurmdTimeout=30", "InactiveLimit=0",
            "GresTypes=gpu",
            *(f"NodeName={node} NodeAddr=127.0.0.1 CPUs={self.cpus} Gres=gpu:{gpus} State=UNKNOWN"
              + (f" NodeHostname={host} Port={unclaimed_port()}" if several else "") for node in names),
            f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")
        for node in names if several else ():
            (root / "spool" / node).mkdir(exist_ok=True)
        (root / "gres.conf").write_text("AutoDetect=off\n" + "".join(
            f"NodeName={node} Name=gpu File={f}\n" for node in names for f in _FAKE_GPU_FILES[:gpus]))

    def start(self, timeout_s: float = 30.0) -> "LocalSlurm":
        """Start munged, slurmctld and the slurmd(s); return once every node is idle (or raise saying why)."""
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
            *([_binary("slurmd"), "-f", conf] + (["-N", node] if self.nodes > 1 else []) for node in self.node_names),
        ]
        env = {**os.environ, **self.env}
        for command in steps:  # each daemonises itself and writes its pid file
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
            if done.returncode != 0:
                raise RuntimeError(f"{Path(command[0]).name} did not start: {done.stderr.strip()}\n{self.logs()}")
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=env,
                                 timeout=30)
            states = out.stdout.split()
            state = ", ".join(states)
            if len(states) == self.nodes and all(s in ("idle", "mixed", "allocated") for s in states):
                return self
            time.sleep(0.3)
        raise RuntimeError(f"the local Slurm node(s) are {state or 'not known'} after {timeout_s:.0f} s\n{self.logs()}")

    def _pid_files(self) -> list[Path]:
        slurmd = sorted(self.root.glob("slurmd*.pid"))  # slurmd.pid, or slurmd-n1.pid, slurmd-n2.pid, ...
        return slurmd + [self.root / "slurmctld.pid", self.root / "munge" / "munged.pid"]

    def pids(self) -> list[int]:
        found = []
        for path in self._pid_files():
            try:
                found.append(int(path.read_text().strip()))
            except (OSError, ValueError):
                pass
        return found

    def stop(self) -> None:
        """End the daemons this folder's pid files name (slurmd first), waiting for each."""
        files = self._pid_files()
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
        for path in files:
            path.unlink(missing_ok=True)

    def logs(self, lines: int = 15) -> str:
        texts = []
        for path in sorted((self.root / "log").glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            texts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(texts)


def main(argv: list[str]) -> int:
    nodes = 1
    if len(argv) == 4 and argv[2] == "--nodes" and argv[3].isdigit() and int(argv[3]) >= 1:
        nodes, argv = int(argv[3]), argv[:2]
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__)
        return 2
    cluster = LocalSlurm(Path(argv[1]).resolve(), nodes=nodes)
    if argv[0] == "start":
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
