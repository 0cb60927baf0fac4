"""What the GPU benchmarks share: one run's row (throughput, MFU, memory predicted vs measured)
and a cold ``torchrun`` of bench/plain_torchrun.py.  Imports neither IPython nor mnb's magics,
so scripts for the device machine (no IPython there) can use it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MEASURED_PEAK_FLOPS = 790e12  # bf16 GEMM peak measured on this H200 (8192^3 matmul)
GIB = 2**30
HERE = Path(__file__).resolve().parent


def run_row(run, train: str) -> dict:
    tokens = [x for x in run.tokens_per_s[1:] if x]
    step_times = [x for x in run.step_times_s[1:] if x]
    flops = run.model_flops_per_step
    row = {"layout": run.layout.describe(), "train": train, "m": run.num_microbatches,
           "tokens_per_s": round(sum(tokens) / len(tokens)) if tokens else None,
           "mfu_vs_790": round(flops / (sum(step_times) / len(step_times)) / run.world_size / MEASURED_PEAK_FLOPS, 3)
           if step_times else None}
    predicted = run.predicted_memory
    worst = 0.0
    for rank, rec in sorted(run.ranks.items()):
        measured = rec["memory"]["peak_allocated_bytes"]
        pred = predicted.for_rank(rank).total_bytes
        row[f"r{rank}_meas_GiB"] = round(measured / GIB, 2)
        row[f"r{rank}_pred_GiB"] = round(pred / GIB, 2)
        worst = max(worst, abs(pred - measured) / measured)
    row["worst_mem_err"] = round(worst, 3)
    if run.layout.pp > 1:
        row["bubble_measured"] = round(run.measured_bubble, 3)
        row["bubble_theory"] = round(run.theoretical_bubble, 3)
    return row


def plain_torchrun(out: Path, *, nproc: int, layout: str, steps: int, mbs: int, gbs: int,
                   preset: str = "llama-1b", seq: int = 2048, device: str = "cuda", bf16: bool = True,
                   extra: tuple[str, ...] = ()) -> dict:
    """Launch bench/plain_torchrun.py cold and read its JSON result."""
    tag = "".join(f"_{x.strip('-')}" for x in extra)
    result = out / f"plain_{nproc}_{layout.replace('=', '').replace(',', '_')}_{steps}{tag}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "plain_torchrun.py"), "--layout", layout, "--steps", str(steps), "--mbs", str(mbs),
           "--gbs", str(gbs), "--preset", preset, "--seq", str(seq), "--device", device,
           "--result", str(result), *extra] + ([] if bf16 else ["--fp32"])
    env = dict(os.environ, MNB_LAUNCH_T=repr(time.time()))
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // nproc)))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode or not result.exists():
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        return {"error": f"exit {proc.returncode}"}
    return json.loads(result.read_text())


class Rows:
    """Rows of a benchmark by section, printed as they come and rewritten to ``out/name`` each time
    (a call cut short by the device's time limit still leaves every row measured so far)."""

    def __init__(self, out: Path, name: str):
        self.out, self.name, self.rows = out, name, {}

    def add(self, section: str, row: dict) -> None:
        print(f"[{section}] {json.dumps(row, default=str)}", flush=True)
        self.rows.setdefault(section, []).append(row)
        (self.out / self.name).write_text(json.dumps(self.rows, indent=1, default=str))


def standby_ready(pool, timeout_s: float = 300) -> None:
    """Wait until the pool's standby has finished launching (ready for go, failed, or none)."""
    deadline = time.monotonic() + timeout_s
    from mnb.controller.standby import DEFERRED

    while (pool.standby_status() or {}).get("state") in ("launching", DEFERRED) and time.monotonic() < deadline:
        time.sleep(0.05)


def timed_restart(pool, kill_cell: str) -> tuple[float, str]:
    """Kill a rank by ``kill_cell`` once the standby is ready; the seconds from that cell's return to
    the next cell done (the automatic restart), and the pool's start note (did it adopt the standby?)."""
    from mnb.errors import PoolError

    standby_ready(pool)
    try:
        pool.run(kill_cell, timeout=120)
    except PoolError:
        pass
    began = time.perf_counter()
    pool.run("x = rank")
    return time.perf_counter() - began, pool.start_note

