"""Every GPU check of mnb in one run, through the real magics (device machine, 2 GPUs).

    python bench/gpu_checks.py --out OUTDIR [--sections magics,parity,memory,mfu,sweep]

Sections (each writes its rows into OUTDIR/gpu_checks.json and .md):

magics   ``%mnb start --device cuda`` (time to ready); NCCL all_reduce under
         ``%%megatron --tp 2``; re-layout to ``--pp 2`` in the same processes; the
         pool's first model (one-time costs: fused-kernel compile); then the time
         from a layout change to the first finished Megatron step, against a cold
         ``torchrun`` launch of the same step (bench/plain_torchrun.py).
parity   bf16 loss after 20 steps under tp1·dp2, tp2 and pp2 (same seed, same data).
memory   >= 6 layouts of llama-1b (tp, pp, dp, sp, recompute, distributed optimizer):
         predicted peak memory (mnb.estimate) against measured peak allocated, per
         rank; measured bubble against (p-1)/m; MFU per run.
fusions  llama-1b on 1 GPU through the pool, Megatron's unfused ops against
         Megatron's own fusions and against mnb's (``mnb.gpt(fusions=...)``): MFU,
         memory, the loss after the same steps, and a kernel profile of one step
         (bench/kernel_profile.py).  MNB_FUSION_VARIANTS picks variants by name.
mfu      llama-1b on 1 GPU through the pool: MFU against the measured bf16 GEMM
         peak (790 TFLOP/s), tokens/s, peak memory; the same run in a plain
         torchrun script: throughput ratio pool / plain.
bubble   pp=2 with equal stages (uneven layer split balancing the output layer):
         measured bubble against (p-1)/m for m = 4, 8, 16.
sweep    mnb.sweep over tp/pp/micro batch on 2 GPUs (table and chart).

Environment knobs to fit a short device budget: MNB_COLD_S (reuse a measured cold
torchrun time instead of launching one), MNB_SKIP_PLAIN, MNB_MFU_MBS / MNB_MFU_GBS.
A pool is started only when a section needs a different one (2 GPUs, or 1 for
fusions and mfu).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from IPython.core.interactiveshell import InteractiveShell

import mnb
from gpu_measure import GIB, MEASURED_PEAK_FLOPS, plain_torchrun, run_row  # noqa: F401

HERE = Path(__file__).resolve().parent
TWO_GPU_SECTIONS = ("parity", "memory", "bubble", "sweep")


def flags(layout: dict) -> str:
    return " ".join(f"--{k} {v}" if not isinstance(v, bool) else (f"--{k}" if v else "--no-sp")
                    for k, v in layout.items())


class Checks:
    def __init__(self, out: Path):
        self.out = out
        self.rows: dict[str, list[dict]] = {}
        self.shell = InteractiveShell.instance()
        self.shell.run_line_magic("load_ext", "mnb")
        self.pool_args: str | None = None

    def cell(self, line: str, code: str) -> float:
        t = time.perf_counter()
        self.shell.run_cell_magic("megatron", line, code)
        return time.perf_counter() - t

    def pool(self, args: str, *, fresh: bool = False) -> None:
        """Start the pool a section needs, unless the running one is already that."""
        if fresh or args != self.pool_args:
            if self.pool_args is not None:
                self.shell.run_line_magic("mnb", "stop")
            self.shell.run_line_magic("mnb", f"start {args}")
            self.pool_args = args

    def add(self, section: str, row: dict) -> None:
        print(f"[{section}] {json.dumps(row, default=str)}", flush=True)
        self.rows.setdefault(section, []).append(row)
        self.save()

    def save(self) -> None:
        (self.out / "gpu_checks.json").write_text(json.dumps(self.rows, indent=1, default=str))
        lines = []
        for section, rows in self.rows.items():
            keys = list(dict.fromkeys(k for r in rows for k in r))
            lines += [f"### {section}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in rows]
            lines.append("")
        (self.out / "gpu_checks.md").write_text("\n".join(lines))

    # ------------------------------------------------------------------ sections
    def magics(self) -> None:
        t = time.perf_counter()
        self.pool("--device cuda", fresh=True)
        self.add("magics", {"check": "%mnb start --device cuda", "world": mnb.pool().world_size,
                            "seconds": round(time.perf_counter() - t, 2)})
        self.cell("--tp 2", "x = torch.ones(1, device=device) * (rank + 1)\ndist.all_reduce(x)\n"
                  "assert x.item() == 3 and ps.get_tensor_model_parallel_world_size() == 2\nprint('nccl tp2 ok')")
        self.add("magics", {"check": "tp=2 NCCL all_reduce", "ok": True})
        seconds = self.cell("--tp 1 --pp 2", "assert ps.get_pipeline_model_parallel_world_size() == 2\n"
                            "print('pp2 stage', ps.get_pipeline_model_parallel_rank())")
        self.add("magics", {"check": "re-layout tp2 -> pp2 in place", "seconds": round(seconds, 3)})
        # Layout change to the first finished step, against a cold torchrun launch of the same job.
        # First a model at tp1 (dp2): the pool's first model pays the one-time costs of a rank
        # process (fused-kernel compile); then the layout change the pool exists for.
        job = ("import time\nmodel = None\nt0 = time.perf_counter()\nmodel = mnb.gpt('llama-1b', seq_length=2048)\n"
               "t1 = time.perf_counter()\nmnb.train(model, steps=1, micro_batch_size=1, global_batch_size=2, bf16=True)\n"
               "t2 = time.perf_counter()\nmnb.train(model, steps=1, micro_batch_size=1, global_batch_size=2, bf16=True)\n"
               "parts = (round(t1 - t0, 2), round(t2 - t1, 2), round(time.perf_counter() - t2, 2))")
        for name, line in (("first model in new ranks (tp1 dp2)", "--tp 1 --pp 1"), ("after a layout change (tp2)", "--tp 2")):
            relayout = self.cell(line, "pass")
            total = relayout + self.cell("", job)
            build_s, first_s, second_s = mnb.pool().pull("parts")[0]
            self.add("magics", {"check": f"breakdown: {name}", "relayout_s": round(relayout, 3), "gpt_s": build_s,
                                "first_step_s": first_s, "second_step_s": second_s,
                                "to_first_step_s": round(total - second_s, 2)})
        warm = total - second_s
        cold = ({"first_step_s": float(os.environ["MNB_COLD_S"])} if os.environ.get("MNB_COLD_S") else
                plain_torchrun(self.out, nproc=2, layout="tp=2", steps=1, mbs=1, gbs=2))
        self.add("magics", {"check": "layout change -> first step (llama-1b, tp2)", "pool_s": round(warm, 2),
                            "cold_torchrun_s": cold.get("first_step_s"), "speedup":
                            round(cold["first_step_s"] / warm, 1) if cold.get("first_step_s") else None})

    def parity(self) -> None:
        losses = {}
        for layout in ({"tp": 1, "pp": 1}, {"tp": 2, "pp": 1}, {"tp": 1, "pp": 2}):
            self.cell(flags(layout), "model = mnb.gpt('llama-1b', num_layers=4, seq_length=1024, seed=7)\n"
                      "mnb.train(model, steps=20, micro_batch_size=2, global_batch_size=16, lr=3e-4, bf16=True, "
                      "data='stdlib', seed=7);")
            run = mnb.last_run
            losses[run.layout.describe()] = run.losses
        base_name, base = next(iter(losses.items()))
        for name, values in losses.items():
            self.add("parity", {"layout": name, "loss_step1": round(values[0], 4), "loss_step20": round(values[-1], 4),
                                "rel_diff_vs_" + base_name.replace(" ", "_"): round(abs(values[-1] - base[-1]) / base[-1], 4)})

    def memory(self) -> None:
        # `model = None` first: a rebuilt model under the same layout would otherwise
        # coexist with the previous one while it is built (a layout change frees it anyway).
        base = ("model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()\n"
                "model = mnb.gpt('llama-1b', seq_length=2048)\nmnb.train(model, steps=6, bf16=True, {train});")
        cases = [
            ({"tp": 1, "pp": 1}, "micro_batch_size=1, global_batch_size=8"),
            ({"tp": 1, "pp": 1}, "micro_batch_size=2, global_batch_size=8, use_distributed_optimizer=True"),
            ({"tp": 2, "pp": 1, "sp": False}, "micro_batch_size=1, global_batch_size=8"),
            ({"tp": 2, "pp": 1, "sp": True}, "micro_batch_size=2, global_batch_size=8"),
            ({"tp": 1, "pp": 2, "sp": False}, "micro_batch_size=4, global_batch_size=16"),
            ({"tp": 1, "pp": 2}, "micro_batch_size=1, global_batch_size=8"),
            ({"tp": 1, "pp": 1}, "micro_batch_size=2, global_batch_size=8, recompute='selective'"),
            ({"tp": 1, "pp": 1}, "micro_batch_size=2, global_batch_size=8, recompute='full'"),
        ]
        for layout, train in cases:
            try:
                self.cell(flags(layout), base.format(train=train))
            except Exception as exc:  # a failed case is a row with its reason; the others still run
                print("\n".join(getattr(exc, "_render_traceback_", lambda: [str(exc)])()), flush=True)
                self.add("memory", {"layout": flags(layout), "train": train, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            self.add("memory", run_row(mnb.last_run, train))

    def bubble(self) -> None:
        """pp=2 with equal stages: llama-1b's 128k-vocabulary output layer weighs about four
        decoder layers, so the first stage gets 10 layers and the last 6 (+ output layer)."""
        for gbs in (16, 32, 64):
            self.cell("--tp 1 --pp 2", "model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()\n"
                      "model = mnb.gpt('llama-1b', seq_length=2048, num_layers_in_first_pipeline_stage=10, "
                      "num_layers_in_last_pipeline_stage=6)\n"
                      f"mnb.train(model, steps=5, micro_batch_size=4, global_batch_size={gbs}, bf16=True);")
            run = mnb.last_run
            stages = {}
            for ev in run.timeline(run.timeline_steps()[-1]):
                if ev["kind"] in ("forward", "backward"):
                    stages.setdefault((ev["stage"], ev["kind"]), []).append(ev["end_s"] - ev["start_s"])
            self.add("bubble", {"layout": "tp1 pp2 (10+6 layers)", "m": run.num_microbatches,
                                "bubble_measured": round(run.measured_bubble, 3),
                                "bubble_theory": round(run.theoretical_bubble, 3),
                                "tokens_per_s": round(sum(run.tokens_per_s[1:]) / len(run.tokens_per_s[1:])),
                                **{f"s{st}_{kind[0]}_ms": round(1000 * sum(v) / len(v), 1)
                                   for (st, kind), v in sorted(stages.items())}})

    def fusions(self) -> None:
        self.pool("-n 1 --gpus 0")
        mbs, gbs = int(os.environ.get("MNB_MFU_MBS", 8)), int(os.environ.get("MNB_MFU_GBS", 64))
        variants = {
            "unfused": "fusions=False",
            "megatron-fusions": "fusions=False, bias_activation_fusion=True, "
                                "cross_entropy_loss_fusion=True, cross_entropy_fusion_impl='native'",
            "mnb-fusions": "fusions=True",
            "mnb-fusions-mbs16": "fusions=True",
        }
        chosen = os.environ.get("MNB_FUSION_VARIANTS", ",".join(variants)).split(",")
        for name in chosen:
            b, g = (16, 2 * gbs) if name.endswith("mbs16") else (mbs, gbs)
            train = f"micro_batch_size={b}, global_batch_size={g}, bf16=True"
            try:
                self.cell("", f"model = None\nmodel = mnb.gpt('llama-1b', seq_length=2048, {variants[name]})\n"
                          f"mnb.train(model, steps=8, {train});")
                run = mnb.last_run
                row = {"variant": name, **run_row(run, f"mbs {b}, gbs {g}, 1 GPU"),
                       "first_step_s": round(run.step_times_s[0], 2), "loss_step8": round(run.losses[-1], 4)}
                self.cell("", f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
                          "from kernel_profile import profile_step\n"
                          f"profile = profile_step(model, {train})")
                profile = mnb.pool().pull("profile")[0]
                (self.out / f"profile_{name}.json").write_text(json.dumps(profile, indent=1))
                row.update(busy_share=profile["busy_share"], step_wall_s=profile["wall_s"],
                           **{f"{k}_s": v for k, v in profile["groups_s"].items()})
            except Exception:
                row = {"variant": name, "error": traceback.format_exc()[-1200:]}
            self.add("fusions", row)
        self.cell("", "model = None")

    def mfu(self) -> None:
        self.pool("-n 1 --gpus 0")
        job = dict(steps=12, mbs=int(os.environ.get("MNB_MFU_MBS", 8)), gbs=int(os.environ.get("MNB_MFU_GBS", 64)))
        self.cell("", "model = mnb.gpt('llama-1b', seq_length=2048)\n"
                  f"mnb.train(model, steps={job['steps']}, micro_batch_size={job['mbs']}, "
                  f"global_batch_size={job['gbs']}, bf16=True);")
        run = mnb.last_run
        row = run_row(run, f"mbs {job['mbs']}, gbs {job['gbs']}, 1 GPU")
        plain = ({} if os.environ.get("MNB_SKIP_PLAIN") else
                 plain_torchrun(self.out, nproc=1, layout="tp=1", steps=job["steps"], mbs=job["mbs"], gbs=job["gbs"]))
        row["plain_tokens_per_s"] = plain.get("tokens_per_s")
        if plain.get("tokens_per_s"):
            row["pool/plain"] = round(row["tokens_per_s"] / plain["tokens_per_s"], 3)
        self.add("mfu", row)

    def sweep(self) -> None:
        result = mnb.sweep({"tp": [1, 2], "pp": [1, 2], "micro_batch_size": [1, 2]}, steps=4,
                           model="llama-1b", global_batch_size=8, bf16=True, model_overrides={"seq_length": 2048})
        for row in getattr(result, "rows", []):
            self.add("sweep", {k: v for k, v in (row.items() if isinstance(row, dict) else vars(row).items())
                               if not isinstance(v, (list, dict))})
        (self.out / "sweep.txt").write_text(result.table())
        ax = result.plot()
        if ax is not None:
            ax.figure.savefig(self.out / "sweep.png", dpi=110)


def _fmt(value) -> str:
    return "" if value is None else str(value)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "artifacts"))
    parser.add_argument("--sections", default="magics,parity,memory,bubble,mfu,sweep")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checks = Checks(out)
    sections = args.sections.split(",")
    for name in sections:
        t = time.perf_counter()
        if name in TWO_GPU_SECTIONS:
            checks.pool("--device cuda")
        try:
            getattr(checks, name)()
        except Exception as exc:
            print("\n".join(getattr(exc, "_render_traceback_", lambda: [])()), flush=True)
            checks.add(name, {"error": traceback.format_exc()[-1500:]})
        print(f"== {name} took {time.perf_counter() - t:.1f} s", flush=True)
    if mnb.controller.current_pool(required=False) is not None:
        checks.shell.run_line_magic("mnb", "stop")


if __name__ == "__main__":
    main()
