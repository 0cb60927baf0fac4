"""Launch real gloo ranks for the mnb.megatron tests (no mocks).

``run_ranks(fn, world_size, tmp_path, **kwargs)`` starts ``world_size``
fresh Python processes on 127.0.0.1 (a free port), each of which runs
:mod:`tests.megatron._rank_main`: ``cpu.install()``, ``init_process_group("gloo")``,
then ``fn(**kwargs)`` where fn is a module-level function of a test file.  Each
rank's JSON-able return value comes back in rank order; a failing rank raises
with its traceback.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

RANK_MAIN = Path(__file__).with_name("_rank_main.py")
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world_size: int, tmp_path: Path, *, timeout_s: float = 300, **kwargs) -> list:
    """Run ``fn(**kwargs)`` on ``world_size`` gloo ranks; return their results in rank order."""
    out = Path(tmp_path) / f"ranks-{fn.__name__}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    (out / "kwargs.json").write_text(json.dumps(kwargs))
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            CUDA_VISIBLE_DEVICES="",
        )
        cmd = [sys.executable, str(RANK_MAIN), inspect.getfile(fn), fn.__name__, str(out)]
        log = open(out / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    failed: list[int] = []
    first_failure: float | None = None
    try:
        while True:
            codes = [proc.poll() for proc, _ in procs]
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
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failed:
        reports = []
        for rank in failed:
            err = out / f"rank{rank}.err"
            text = err.read_text() if err.exists() else (out / f"rank{rank}.log").read_text()[-4000:]
            reports.append(f"--- rank {rank} ---\n{text}")
        raise RuntimeError(f"ranks {failed} of {world_size} failed:\n" + "\n".join(reports))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
