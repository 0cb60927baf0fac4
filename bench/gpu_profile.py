"""A llama-1b step profiled on one GPU: overhead, trace size, kernel table, memory snapshot peak.

    python bench/gpu_profile.py --out gpu-out/profile.json

One-rank CUDA pool (the pool API; the GPU machine has no IPython): 6 steps unprofiled, then
6 steps with steps 2-3 profiled (``--memory``).  Reports the profiled steps' time against the
unprofiled median, the per-rank trace's size, ``mnb.last_profile``'s top operators and shares,
and the CUDA memory snapshot's peak (replayed from its trace) beside
``torch.cuda.max_memory_allocated`` of the same steps.

Not run yet: written in session i28 when no device time was left (run it with
``run(command="... python3 bench/gpu_profile.py --out $OUT/profile.json", carry=[".whl"])``
after bench/gpu_session.sh's wheel install).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

MODEL = "model = mnb.gpt('llama-1b', seq_length=2048)"
TRAIN = "mnb.train(model, steps=6, micro_batch_size=2, global_batch_size=8, bf16=True, data='mock')"

SNAPSHOT_PEAK = '''
import pickle
def _snapshot_peak(path):
    snap = pickle.load(open(path, "rb"))
    now = sum(b["size"] for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated")
    peak = now
    for event in reversed([e for trace in snap["device_traces"] for e in trace]):
        if event["action"] == "alloc":
            now -= event["size"]
        elif event["action"] == "free_completed":
            now += event["size"]
        peak = max(peak, now)
    return peak
'''


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-out/profile.json")
    args = parser.parse_args()
    from mnb.controller import Pool, last_run
    from mnb.profiles import Profile

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pool = Pool.start(1, device="cuda", timeout=300)
    try:
        pool.run(MODEL, quiet=True)
        pool.run(TRAIN, quiet=True)
        plain = [s["step_time_s"] for s in last_run().records_by_rank[0]["steps"]][1:]
        folder = out.parent / "profile-folder"
        start = time.perf_counter()
        pool.run(TRAIN, quiet=True, profile={"dir": str(folder.resolve()), "steps": "2-3", "ranks": None,
                                             "memory": True})
        run = last_run()
        steps = run.records_by_rank[0]["steps"]
        prof = Profile(folder)
        mem = prof.memory().get(0, {})
        snap_peak = None
        if mem.get("snapshot"):
            pool.run(SNAPSHOT_PEAK, quiet=True)
            snap_peak = pool.run(f"_snapshot_peak({mem['snapshot']!r})")[0]
        result = {
            "unprofiled_step_s_median": statistics.median(plain),
            "profiled_step_s": prof.step_cost_s().get(0),
            "profiled_rows_step_time_s": [s["step_time_s"] for s in steps[1:3]],
            "overhead": prof.step_cost_s().get(0, 0) / statistics.median(plain) - 1,
            "trace_bytes": prof.trace_bytes,
            "merged_bytes": prof.path.stat().st_size,
            "shares": prof.shares(),
            "top": prof.table(15),
            "memory_peak_bytes_counted": mem.get("peak_bytes"),
            "snapshot_peak_bytes": snap_peak,
            "max_memory_allocated_profiled_steps": max(s["mem_peak_bytes"] for s in steps[1:3]),
            "cell_s": time.perf_counter() - start,
        }
        out.write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps({k: v for k, v in result.items() if k != "top"}, indent=1, default=str))
        for row in result["top"]:
            print(f"{row['name'][:90]:<90} {row['self_us'] / 1e3:9.2f} ms x{row['calls']}")
    finally:
        pool.stop()


if __name__ == "__main__":
    main()
