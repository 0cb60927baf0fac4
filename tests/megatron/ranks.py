"""Launch real gloo ranks for the mnb.megatron tests (no mocks).

``run_ranks(fn, world_size, tmp_path, **kwargs)`` starts ``world_size``
fresh Python processes on 127.0.0.1 (the rendezvous store held by the test's
process, below), each of which runs
:mod:`tests.megatron._rank_main`: ``cpu.install()`` (unless ``cpu_mode=False``),
``init_process_group("gloo")``, then ``fn(**kwargs)`` where fn is a module-level
function of a test file.  Each rank's JSON-able return value comes back in rank
order; a failing rank raises with its traceback.

``start_ranks`` is the same launch without the wait, for a test that kills the ranks
itself (``Ranks.kill`` ends each rank's whole process group: every rank leads its own
session, so what it started, e.g. Megatron's asynchronous checkpoint writers, goes too).
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RANK_MAIN = Path(__file__).with_name("_rank_main.py")
REPO = Path(__file__).resolve().parents[2]


def rendezvous_store():
    """A ``TCPStore`` server in this process, listening on a port the OS picks, for one launch's ranks to meet
    at as torchrun's ranks meet at its agent's store (``TORCHELASTIC_USE_AGENT_STORE=True``: every rank a
    client).  A port found free here and left for rank 0 to bind seconds later, once it has imported torch,
    was taken in between once on CI's loaded machine (``EADDRINUSE``, 2026-12-05); a port held from the start
    cannot be."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))


class Ranks:
    """One launch of ``world_size`` rank processes (``start_ranks``)."""

    def __init__(self, procs: list[subprocess.Popen], logs: list, out: Path, store=None):
        self.procs, self._logs, self.out = procs, logs, out
        self._store = store  # the ranks' rendezvous: kept while they run

    def log(self, rank: int) -> str:
        return (self.out / f"rank{rank}.log").read_text()

    def kill(self) -> None:
        """SIGKILL every rank and what it started (its process group); wait for the ranks."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        for log in self._logs:
            log.close()
        self._store = None

    def wait(self, timeout_s: float = 300) -> list:
        """The ranks' results in rank order; a failing or stuck rank raises with its traceback."""
        world_size = len(self.procs)
        deadline = time.monotonic() + timeout_s
        failed: list[int] = []
        first_failure: float | None = None
        try:
            while True:
                codes = [proc.poll() for proc in self.procs]
                failed = [r for r, rc in enumerate(codes) if rc not in (None, 0)]
                if all(rc is not None for rc in codes):
                    break
                now = time.monotonic()
                if failed and first_failure is None:
                    first_failure = now  # the others are likely stuck in a collective
                if now > deadline or (first_failure is not None and now - first_failure > 10):
                    failed = sorted(set(failed) | {r for r, rc in enumerate(codes) if rc is None})
                    break
                time.sleep(0.05)
        finally:
            self.kill()
        if failed:
            reports = []
            for rank in failed:
                err = self.out / f"rank{rank}.err"
                text = err.read_text() if err.exists() else self.log(rank)[-4000:]
                reports.append(f"--- rank {rank} ---\n{text}")
            raise RuntimeError(f"ranks {failed} of {world_size} failed:\n" + "\n".join(reports))
        return [json.loads((self.out / f"rank{r}.json").read_text()) for r in range(world_size)]


def start_ranks(fn, world_size: int, tmp_path: Path, *, cpu_mode: bool = True, **kwargs) -> Ranks:
    """Start ``fn(**kwargs)`` on ``world_size`` gloo ranks; ``Ranks.wait`` or ``Ranks.kill`` ends them."""
    from tests import session_report

    session_report.count_rank_launch()
    out = Path(tmp_path) / f"ranks-{fn.__name__}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    (out / "kwargs.json").write_text(json.dumps(kwargs))
    store = rendezvous_store()
    procs, logs = [], []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            CUDA_VISIBLE_DEVICES="",
            MNB_TEST_CPU_MODE="1" if cpu_mode else "0",
        )
        cmd = [sys.executable, str(RANK_MAIN), inspect.getfile(fn), fn.__name__, str(out)]
        log = open(out / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return Ranks(procs, logs, out, store)


def run_ranks(fn, world_size: int, tmp_path: Path, *, timeout_s: float = 300, cpu_mode: bool = True,
              **kwargs) -> list:
    """Run ``fn(**kwargs)`` on ``world_size`` gloo ranks; return their results in rank order."""
    return start_ranks(fn, world_size, tmp_path, cpu_mode=cpu_mode, **kwargs).wait(timeout_s)
