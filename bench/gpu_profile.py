"""A llama-1b step profiled on one GPU: overhead, trace size, kernel table, memory peak, HTA's analyses.

    python bench/gpu_profile.py --out gpu-out/profile.json                       # the device machine
    python bench/gpu_profile.py --device cpu --model tiny --out /tmp/p/profile.json   # a dry run on CPU

One-rank pool (the pool API; the GPU machine has no IPython): 6 steps unprofiled, then 6 steps
with steps 2-3 profiled (``--memory``), then one step through bench/kernel_profile.py's own
``torch.profiler`` (the kernel table to compare with).  Reports the profiled steps' time against
the unprofiled median, the per-rank trace's and the merged file's size, ``mnb.last_profile``'s
kernel time per step by kernel_profile's categories beside kernel_profile's, the memory figure's
peak (the allocator's bytes replayed from the CUDA memory snapshot) beside
``torch.cuda.max_memory_allocated`` of the same steps and an independent replay of the snapshot
file, and Holistic Trace Analysis's GPU-kernel breakdown and communication/computation overlap
on the per-rank folder.  Needs HolisticTraceAnalysis and its pure dependencies (carried as wheels
in .whl/ on the device machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_profile import category  # noqa: E402

SNAPSHOT_PEAK = '''
import pickle
def _snapshot_peak(path):
    snap = pickle.load(open(path, "rb"))
    now = sum(b["size"] for seg in snap["segments"] for b in seg["blocks"]
              if b["state"] in ("active_allocated", "active_pending_free"))
    peak = now
    for event in reversed([e for trace in snap["device_traces"] for e in trace]):
        if event["action"] == "alloc":
            now -= event["size"]
        elif event["action"] == "free_completed":
            now += event["size"]
        peak = max(peak, now)
    return peak
'''


def kernel_groups(prof, rank: int = 0) -> dict[str, float]:
    """Seconds per profiled step of the rank's GPU kernels inside its profiled steps, by kernel_profile's category."""
    windows = prof.steps(rank)
    groups: dict[str, float] = {}
    for e in prof.rank_events(rank):
        if e.get("cat") != "kernel" or not any(a <= e["ts"] < b for a, b in windows):
            continue
        groups[category(e["name"])] = groups.get(category(e["name"]), 0.0) + e.get("dur", 0) / 1e6
    return {k: round(v / max(1, len(windows)), 4) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}


def hta_analyses(trace_dir: Path) -> dict:
    """HTA's GPU-kernel breakdown and comm/comp overlap of the folder (each analysis's error, if it raises)."""
    out: dict = {}
    try:
        from hta.trace_analysis import TraceAnalysis

        start = time.perf_counter()
        analyzer = TraceAnalysis(trace_dir=str(trace_dir))
        out["parse_s"] = round(time.perf_counter() - start, 2)
        out["ranks"] = sorted(analyzer.t.traces)
    except Exception as exc:  # noqa: BLE001 - a bench row says what failed
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        kernel_type, kernels = analyzer.get_gpu_kernel_breakdown(visualize=False)
        out["kernel_type"] = kernel_type.to_dict(orient="records")
        out["top_kernels"] = kernels.head(10).to_dict(orient="records")
    except Exception as exc:  # noqa: BLE001
        out["kernel_breakdown_error"] = f"{type(exc).__name__}: {exc}"
    try:
        out["comm_comp_overlap"] = analyzer.get_comm_comp_overlap(visualize=False).to_dict(orient="records")
    except Exception as exc:  # noqa: BLE001
        out["comm_comp_overlap_error"] = f"{type(exc).__name__}: {exc}"
    return out


def figures(prof, where: Path) -> None:
    """The merged timeline and the memory figure as PNGs, where matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("no matplotlib: no figures")
        return
    prof.plot().savefig(where / "profile_timeline.png", dpi=80)
    prof.plot_memory().savefig(where / "profile_memory.png", dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-out/profile.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--folder", default=None, help="the profile folder (default beside --out)")
    args = parser.parse_args()
    from mnb.controller import Pool, last_run
    from mnb.notebook.profiles import Profile

    cuda = args.device == "cuda"
    model = (f"model = mnb.gpt({args.model!r}, seq_length=2048)" if cuda else
             f"model = mnb.gpt({args.model!r}, num_layers=2, hidden_size=64, ffn_hidden_size=128, seq_length=32)")
    train_kw = "micro_batch_size=2, global_batch_size=8, data='mock'" + (", bf16=True" if cuda else "")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pool = Pool.start(1, device=args.device, timeout=300)
    try:
        # Measure the fused model as it trains once compiled: wait for the background compile
        # (mnb.megatron.background_compile), or the first steps run unfused while it works.
        pool.run(model + "\nfrom mnb.megatron import background_compile as _bc\n"
                 "_ = _bc.pending() and _bc.pending().wait()", quiet=True)
        pool.run(f"mnb.train(model, steps=6, {train_kw})", quiet=True)
        plain = [s["step_time_s"] for s in last_run().records_by_rank[0]["steps"]][1:]
        folder = Path(args.folder) if args.folder else out.parent / "profile-folder"
        start = time.perf_counter()
        pool.run(f"mnb.train(model, steps=6, {train_kw})", quiet=True,
                 profile={"dir": str(folder.resolve()), "steps": "2-3", "ranks": None, "memory": True})
        cell_s = time.perf_counter() - start
        run = last_run()
        steps = run.records_by_rank[0]["steps"]
        prof = Profile(folder)
        mem = prof.memory().get(0, {})
        snap_peak = None
        if mem.get("snapshot"):
            pool.run(SNAPSHOT_PEAK, quiet=True)
            snap_peak = pool.run(f"_snapshot_peak({mem['snapshot']!r})")[0]
        pool.run(f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
                 "from kernel_profile import profile_step", quiet=True)
        # kernel_profile's own torch.profiler (CUDA kernels only): the device machine's numbers to compare with
        reference = pool.run(f"profile_step(model, {train_kw})")[0] if cuda else {"groups_s": {}, "wall_s": None}
        cost = prof.step_cost_s().get(0, 0.0)
        result = {
            "unprofiled_step_s_median": statistics.median(plain),
            "profiled_step_s": cost,
            "profiled_rows_step_time_s": [s["step_time_s"] for s in steps[1:3]],
            "overhead": cost / statistics.median(plain) - 1,
            "trace_bytes": prof.trace_bytes,
            "merged_bytes": prof.path.stat().st_size,
            "snapshot_bytes": Path(mem["snapshot"]).stat().st_size if mem.get("snapshot") else None,
            "profiled_cell_s": cell_s,
            "shares": prof.shares(),
            "kernel_s_per_step_mnb_profile": kernel_groups(prof),
            "kernel_s_per_step_kernel_profile": reference["groups_s"],
            "kernel_profile_wall_s": reference["wall_s"],
            "memory_figure_peak_bytes": mem.get("peak_bytes"),
            "memory_source": mem.get("source"),
            "max_memory_allocated_profiled_steps": max(s["mem_peak_bytes"] for s in steps[1:3]),
            "snapshot_file_replayed_peak_bytes": snap_peak,
            "last_run_peak_memory_bytes": run.peak_memory_bytes.get(0),
            "top": prof.table(15),
            "hta": hta_analyses(prof.trace_dir),
        }
        out.write_text(json.dumps(result, indent=1, default=str))
        figures(prof, out.parent)
        print(json.dumps({k: v for k, v in result.items() if k not in ("top", "hta")}, indent=1, default=str))
        print(json.dumps(result["hta"], indent=1, default=str)[:6000])
        for row in result["top"]:
            print(f"{row['name'][:90]:<90} {row['self_us'] / 1e3:9.2f} ms x{row['calls']}")
    finally:
        pool.stop()


if __name__ == "__main__":
    main()
