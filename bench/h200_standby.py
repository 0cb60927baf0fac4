"""Issue 27 on one H200: the standby begun at ``%load_ext mnb``, restart with standby, and a fresh
pool's first llama-1b step that no longer waits for the compiler, against a cold torchrun.

    python bench/h200_standby.py --out OUTDIR      # OUTDIR/h200_standby.json, rows printed as they come

Run as the machine's first call (cold page cache, empty compile cache: ``XDG_CACHE_HOME`` is a new
folder), through the pool API: ``load_standby.begin`` is what ``%load_ext mnb`` calls after
registering the magics (the device machine has no IPython), ``Pool.start()`` with no arguments is a
bare ``%mnb start``.

1. load -> start at once -> first cell (llama-1b, 8 layers, mbs 4, seq 2048, 1 step), back to back:
   the worst case (nobody types that fast); then 8 more steps (which ran unfused) and the same
   model with ``fusions=False`` (losses compared).
2. restart with standby: once the standby waits for go, a cell kills the rank; from that cell's
   return to the next cell done.
3. load -> standby waiting for go -> ``%mnb start`` -> ready, and its first cell (compile cache
   filled by then).
4. a cold ``torchrun`` of the same step with Megatron's own ops (bench/plain_torchrun.py --no-fusions).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu_measure import Rows, plain_torchrun, timed_restart  # noqa: E402

MODEL = "mnb.gpt('llama-1b', num_layers=8, seq_length=2048{extra})"
FIRST_CELL = "model = {model}\nmnb.train(model, steps=1, micro_batch_size={mbs}, global_batch_size={gbs}, bf16=True)"
KILL = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"


def parked_ready(timeout_s: float = 300) -> dict:
    from mnb.controller import standby

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = standby.parked_status()
        if status is not None and status["state"] != "launching":
            return status
        time.sleep(0.05)
    raise TimeoutError("the load-time standby was not ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="h200-standby-out")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the script on a CPU machine: tiny model, MNB_STANDBY_AT_LOAD=1, no torchrun row")
    args = parser.parse_args()
    global MODEL, FIRST_CELL
    mbs = gbs = 4
    if args.dry_run:  # 2 CPU ranks
        os.environ["MNB_STANDBY_AT_LOAD"] = "1"
        MODEL, mbs, gbs = "mnb.gpt('tiny', num_layers=2{extra})", 1, 2
    FIRST_CELL = FIRST_CELL.format(model=MODEL.format(extra=""), mbs=mbs, gbs=gbs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mnb-cold-cache-")  # before mnb: an empty compile cache
    bench = Rows(out, "h200_standby.json")
    import mnb
    from mnb.controller import Pool, load_standby
    from mnb.controller import standby as standbys

    pool = None
    try:  # 1. load, start and first cell back to back
        t0 = time.perf_counter()
        begun = load_standby.begin(pool_running=False)
        pool = Pool.start(timeout=600)
        ready = time.perf_counter() - t0
        t = time.perf_counter()
        pool.run(FIRST_CELL)
        first = time.perf_counter() - t
        summary = str(mnb.last_run.summary())
        bench.add("fresh", {"run": "load -> start at once -> first cell (1 step), cold machine, empty compile cache",
                            "begun_at_load": begun, "start_note": pool.start_note, "load_to_ready_s": round(ready, 2),
                            "first_cell_s": round(first, 2), "load_to_first_step_s": round(ready + first, 2),
                            "unfused_steps": mnb.last_run.unfused_steps, "summary": summary,
                            "timings": pool.start_timings})
        pool.run("mnb.train(model, steps=8)")
        run = mnb.last_run
        switched = [round(x, 4) for x in mnb.last_run.losses]
        bench.add("fresh", {"run": "8 more steps", "unfused_steps": run.unfused_steps,
                            "step_times_s": [round(x, 3) for x in run.step_times_s], "summary": str(run.summary())})
        pool.run(f"plain = {MODEL.format(extra=', fusions=False')}\n"
                 f"mnb.train(plain, steps=1, micro_batch_size={mbs}, global_batch_size={gbs}, bf16=True)\n"
                 "mnb.train(plain, steps=8)")
        plain = [round(x, 4) for x in mnb.last_run.losses]
        bench.add("fresh", {"run": "losses of steps 2-9: switched vs fusions=False", "switched": switched,
                            "unfused": plain, "max_rel_diff": round(max(abs(a - b) / abs(b) for a, b in
                                                                        zip(switched, plain)), 5)})
    except Exception:
        bench.add("fresh", {"error": traceback.format_exc()[-2000:]})
    try:  # 2. restart with standby
        restart_s, note = timed_restart(pool, KILL)
        bench.add("restart", {"run": "automatic restart -> next cell done, standby waiting for go",
                              "restart_to_next_cell_s": round(restart_s, 2), "note": note})
    except Exception:
        bench.add("restart", {"error": traceback.format_exc()[-2000:]})
    finally:
        if pool is not None:
            pool.stop()
        parked = standbys.unpark()
        if parked is not None:
            parked.close()
    try:  # 3. load, the standby waits for go, then %mnb start
        t0 = time.perf_counter()
        load_standby.begin(pool_running=False)
        status = parked_ready()
        waited = time.perf_counter() - t0
        t = time.perf_counter()
        pool = Pool.start(timeout=600)
        ready = time.perf_counter() - t
        t = time.perf_counter()
        pool.run(FIRST_CELL)
        first = time.perf_counter() - t
        bench.add("start", {"run": "load -> standby waiting for go -> %mnb start -> ready (compile cache filled)",
                            "standby_ready_after_load_s": round(waited, 2), "standby_rss_bytes": status["rss_bytes"],
                            "start_note": pool.start_note, "start_to_ready_s": round(ready, 2),
                            "first_cell_s": round(first, 2), "unfused_steps": mnb.last_run.unfused_steps,
                            "timings": pool.start_timings})
        pool.stop()
        parked = standbys.unpark()
        if parked is not None:
            parked.close()
    except Exception:
        bench.add("start", {"error": traceback.format_exc()[-2000:]})
    if args.dry_run:
        return
    cold = plain_torchrun(out, nproc=1, layout="tp=1", steps=1, mbs=4, gbs=4, extra=("--num-layers", "8", "--no-fusions"))
    bench.add("cold", {"run": "cold torchrun of the same step, Megatron's own ops (no compile)", **cold})


if __name__ == "__main__":
    main()
