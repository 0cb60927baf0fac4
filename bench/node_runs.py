"""Full-node layouts through one pool: dense tp/pp/dp/vpp and MoE expert parallelism.

    # 8 GPUs (the node run of the issue; needs the nvidia-h200-x8 machine kind)
    python bench/node_runs.py --out OUTDIR --device cuda -n 8
    # the same script where no such node is lent: CPU ranks with the toy presets
    python bench/node_runs.py --out OUTDIR --device cpu -n 8

One ``%mnb start`` of N ranks; every layout is applied in place between runs.
For each layout: tokens/s per rank, MFU (GPUs), peak memory per rank against the
prediction, measured bubble against (p-1)/m (or (p-1)/(v*m)) and, for MoE, the
share of step time in the token dispatcher's forward dispatch + combine (the
all-to-all; mnb times it on the timeline, the backward direction is not timed).  Then the time from a layout change to the first finished
step against a cold ``torchrun`` launch (bench/plain_torchrun.py) of the same job.
Layouts that do not fit the world size are rows with the reason.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from IPython.core.interactiveshell import InteractiveShell

import mnb
from gpu_checks import GIB, MEASURED_PEAK_FLOPS, plain_torchrun
from mnb.config import ParallelConfig, load_preset

DENSE = [  # (label, flags, train keyword arguments)
    ("tp1 dpN, distributed optimizer", "--tp 1 --pp 1 --vpp 1 --ep 1 --no-sp", "use_distributed_optimizer=True"),
    ("tp2 pp2 dp, sequence parallel", "--tp 2 --pp 2 --vpp 1 --ep 1 --sp", "use_distributed_optimizer=True"),
    ("tp2 pp4 vpp2", "--tp 2 --pp 4 --vpp 2 --ep 1 --no-sp", ""),
]


def moe_layouts(world: int) -> list[tuple[str, str, str]]:
    return [
        (f"ep{world}", f"--tp 1 --pp 1 --vpp 1 --ep {world} --no-sp", ""),
        (f"ep{world // 2} (expert data parallel 2)", f"--tp 1 --pp 1 --vpp 1 --ep {max(1, world // 2)} --no-sp", ""),
    ]


def layout_of(flags: str, world: int) -> ParallelConfig:
    values = flags.split()
    get = lambda name: int(values[values.index(f"--{name}") + 1])  # noqa: E731
    vpp = get("vpp")
    return ParallelConfig(tp=get("tp"), pp=get("pp"), vpp=vpp if vpp > 1 else None, ep=get("ep"),
                          sequence_parallel="--sp" in values).resolve(world)


def row_of(run, label: str) -> dict:
    tokens = [x for x in run.tokens_per_s[1:] if x]
    times = [x for x in run.step_times_s[1:] if x]
    row = {"layout": label, "as_run": run.layout.describe(), "m": run.num_microbatches,
           "tokens_per_s_per_rank": round(sum(tokens) / len(tokens) / run.world_size) if tokens else None}
    if not run.on_cpu and times:
        row["mfu_vs_790"] = round(run.model_flops_per_step / (sum(times) / len(times)) / run.world_size
                                  / MEASURED_PEAK_FLOPS, 3)
    peaks = run.peak_memory_bytes
    worst_rank = max(peaks, key=peaks.get)
    row["peak_GiB_max_rank"] = round(peaks[worst_rank] / GIB, 2)
    if not run.on_cpu:  # CPU memory is the process's resident set: no prediction to compare
        row["predicted_GiB"] = round(run.predicted_memory.for_rank(worst_rank).total_bytes / GIB, 2)
    if run.layout.pp > 1:
        row["bubble_measured"] = round(run.measured_bubble, 3)
        row["bubble_theory"] = round(run.theoretical_bubble, 3)
    step = run.timeline_steps()[-1]
    events = run.timeline(step)
    a2a = sum(e["end_s"] - e["start_s"] for e in events if e["kind"] in ("moe-dispatch", "moe-combine"))
    if run.model.is_moe:  # forward dispatch + combine; the backward all-to-all is not timed
        row["fwd_all_to_all_share"] = round(a2a / max(times[-1], 1e-9), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="artifacts/node_runs")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = args.device == "cuda"
    dense = "llama-8b" if gpu else "tiny"
    moe = "moe" if gpu else "moe-tiny"
    # World-size-8 expert parallelism needs 8 experts; the CPU toy MoE has 4.
    moe_overrides = "" if gpu else ", num_moe_experts=8"
    # pp4 * vpp2 = 8 stages: the CPU toy model gets 8 layers.
    dense_overrides = "" if gpu else ", num_layers=8"
    seq = 4096 if gpu else 64
    mbs, gbs = (1, 64) if gpu else (1, 16)
    precision = "bf16=True" if gpu else "bf16=False"
    rows: list[dict] = []
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    t0 = time.perf_counter()
    shell.run_line_magic("mnb", f"start -n {args.n} --device {args.device} --timeout 600")
    rows.append({"layout": f"%mnb start -n {args.n} --device {args.device}", "seconds": round(time.perf_counter() - t0, 1)})

    def run_case(preset: str, overrides: str, label: str, flags: str, train: str) -> None:
        try:
            layout_of(flags, args.n)
            code = (f"model = None\nmodel = mnb.gpt({preset!r}, seq_length={seq}{overrides})\n"
                    f"mnb.train(model, steps={args.steps}, micro_batch_size={mbs}, global_batch_size={gbs}, "
                    f"{precision}{', ' + train if train else ''});")
            shell.run_cell_magic("megatron", flags, code)
            rows.append(row_of(mnb.last_run, f"{preset}: {label}"))
        except Exception as exc:  # a layout that cannot run is a row with its reason
            rows.append({"layout": f"{preset}: {label}", "error": f"{type(exc).__name__}: {exc}"[:240]})
        print(json.dumps(rows[-1]), flush=True)

    for label, flags, train in DENSE:
        run_case(dense, dense_overrides, label, flags, train)
    for label, flags, train in moe_layouts(args.n):
        run_case(moe, moe_overrides, label, flags, train)

    # Layout change -> first finished step, against a cold torchrun launch of the same job.
    shell.run_cell_magic("megatron", "--tp 1 --pp 1 --vpp 1 --ep 1 --no-sp", "model = None")
    t0 = time.perf_counter()
    shell.run_cell_magic("megatron", "--tp 2 --pp 1",
                         f"model = mnb.gpt({dense!r}, seq_length={seq})\n"
                         f"mnb.train(model, steps=1, micro_batch_size={mbs}, global_batch_size={gbs}, {precision});")
    warm = time.perf_counter() - t0
    shell.run_line_magic("mnb", "stop")
    cold = plain_torchrun(out, nproc=args.n, layout="tp=2", steps=1, mbs=mbs, gbs=gbs, preset=dense, seq=seq,
                          device=args.device, bf16=gpu)
    rows.append({"layout": "layout change -> first step (tp2)", "pool_s": round(warm, 2),
                 "cold_torchrun_s": cold.get("first_step_s"),
                 "speedup": round(cold["first_step_s"] / warm, 1) if cold.get("first_step_s") else cold})
    print(json.dumps(rows[-1]), flush=True)
    (out / "node_runs.json").write_text(json.dumps(rows, indent=1))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    table += ["| " + " | ".join("" if r.get(k) is None else str(r.get(k)) for k in keys) + " |" for r in rows]
    (out / "node_runs.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    load_preset("tiny")  # fail early if the presets are missing
    main()
