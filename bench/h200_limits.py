"""One H200, closer to the limit (issue 18): every measurement in one device call.

    python bench/h200_limits.py --out OUTDIR        # writes OUTDIR/h200_limits.json and .md

1. A fresh pool on a cold machine (empty compile cache: ``XDG_CACHE_HOME`` set to a new folder)
   to its first finished llama-1b step (8 layers, mbs 4, seq 2048): ``Pool.start`` with the
   start-up breakdown (what ``%mnb start --timings`` prints), then the first cell.
2. A cold ``torchrun`` of the same step with Megatron's own ops (bench/plain_torchrun.py
   ``--no-fusions``: no compile), the reference a pool must beat.
3. A second fresh pool (the machine has run mnb before: compile cache filled) to its first step;
   in it a new model to its first step.
4. MFU against the measured 790 TFLOP/s bf16 GEMM peak and peak memory predicted vs measured:
   llama-1b and llama-3b at several micro batches (8 microbatches per step), with and without
   mnb's fused kernels, and llama-1b with Megatron's default (foreach) Adam step for comparison.
5. A kernel profile of llama-3b's best micro batch (bench/kernel_profile.py), and the pool
   against a plain torchrun script doing the same llama-1b steps.
6. ``--sections wgrad``: llama-1b (mbs 16) and llama-3b (mbs 8) with the weight gradients added into
   ``main_grad`` inside the GEMM (``mnb.megatron.wgrad_fusion``, the default on GPUs) and without
   (DDP's hook adds them), the same initial weights and data: MFU and losses side by side.
7. ``--sections norm`` / ``swiglu`` / ``rope`` / ``loss``: the same with each RMSNorm in mnb's Triton kernels
   (``mnb.megatron.norm_kernels``) and as torch's ``F.rms_norm``; with SwiGLU, RoPE, the loss in mnb's Triton
   kernels (``swiglu_kernels``, ``rope_kernels``, ``loss_kernels``) and compiled by Inductor; ``own``: all
   four at once.  mnb's kernels are the default of fused models on GPUs.

Uses the pool API (the device machine has no IPython; ``%mnb`` calls the same methods).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu_measure import Rows, plain_torchrun, run_row  # noqa: E402

FIRST_CELL = ("model = mnb.gpt('llama-1b', num_layers=8, seq_length=2048)\n"
              "mnb.train(model, steps=1, micro_batch_size=4, global_batch_size=4, bf16=True)")
STEPS = 6


class Bench(Rows):
    def __init__(self, out: Path):
        super().__init__(out, "h200_limits.json")

    def fresh_pool(self, label: str, think_s: float = 0.0):
        """Start a pool and run the first cell ``think_s`` after it is ready (a user typing it)."""
        from mnb.controller import Pool

        start = time.perf_counter()
        pool = Pool.start(1, gpus=[0], timeout=600)
        ready = time.perf_counter() - start
        time.sleep(think_s)
        cell = time.perf_counter()
        pool.run(FIRST_CELL)
        first = time.perf_counter() - cell
        self.add("start", {"pool": label, "ready_s": round(ready, 2), "think_s": think_s,
                           "first_cell_s": round(first, 2), "fresh_pool_to_first_step_s": round(ready + first, 2),
                           "timings": pool.start_timings})
        return pool

    def train_row(self, pool, section: str, preset: str, mbs: int, gbs_per_mbs: int = 8, model_kw: str = "",
                  before: str = "", note: str = "") -> None:
        import mnb

        gbs = mbs * gbs_per_mbs
        label = f"{preset} mbs {mbs} gbs {gbs}" + (f" {model_kw}" if model_kw else "") + (f" ({note})" if note else "")
        try:
            pool.run("model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()\n" + before
                     + f"model = mnb.gpt({preset!r}, seq_length=2048{', ' + model_kw if model_kw else ''})\n"
                     + WAIT_FOR_KERNELS  # what this model compiles (a kernel switched off): its steps run fused
                     + f"mnb.train(model, steps={STEPS}, micro_batch_size={mbs}, global_batch_size={gbs}, bf16=True)")
            self.add(section, {"model": label, **run_row(mnb.last_run, label),
                               "losses": [round(x, 4) for x in mnb.last_run.losses]})
        except Exception:
            self.add(section, {"model": label, "error": traceback.format_exc()[-1500:]})

    def profile(self, pool, preset: str, mbs: int) -> None:
        try:
            pool.run(f"import sys\nsys.path.insert(0, {str(HERE)!r})\nfrom kernel_profile import profile_step\n"
                     "model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()\n"
                     f"model = mnb.gpt({preset!r}, seq_length=2048)\n"
                     f"{WAIT_FOR_KERNELS}"
                     f"mnb.train(model, steps=2, micro_batch_size={mbs}, global_batch_size={8 * mbs}, bf16=True)\n"
                     f"{WAIT_FOR_KERNELS}"  # the fused kernels of this model's own shapes, compiled during its steps
                     f"profile = profile_step(model, micro_batch_size={mbs}, global_batch_size={8 * mbs}, bf16=True)")
            profile = pool.pull("profile")[0]
            (self.out / f"profile_{preset}_mbs{mbs}.json").write_text(json.dumps(profile, indent=1))
            self.add("profile", {"model": f"{preset} mbs {mbs}", "busy_share": profile["busy_share"],
                                 "step_wall_s": profile["wall_s"], "kernel_span_s": profile["kernel_span_s"],
                                 "gaps_s": profile["gaps_s"], **{f"{k}_s": v for k, v in profile["groups_s"].items()}})
        except Exception:
            self.add("profile", {"model": f"{preset} mbs {mbs}", "error": traceback.format_exc()[-1500:]})


WAIT_FOR_KERNELS = ("from mnb.megatron import background_compile\npending = background_compile.pending()\n"
                    "pending.wait(600) if pending is not None else True\n"
                    # the pool's own warm-up of the presets' kernels (mnb/worker/boot.py): the rows that
                    # follow have the GPU and the GIL to themselves
                    "import threading\n[t.join(600) for t in threading.enumerate() if t.name == 'mnb-fused-kernels']\n")


SWITCHES = {  # section: (the modules whose `enabled` it sets, what a row says with them on, and off)
    "wgrad": (("mnb.megatron.wgrad_fusion",), "wgrad fused into the GEMM", "wgrad added by DDP's hook"),
    "norm": (("mnb.megatron.norm_kernels",), "RMSNorm in mnb's Triton kernels", "RMSNorm as torch's F.rms_norm"),
    "swiglu": (("mnb.megatron.swiglu_kernels",), "SwiGLU in mnb's Triton kernels", "SwiGLU compiled by Inductor"),
    "rope": (("mnb.megatron.rope_kernels",), "RoPE in mnb's Triton kernel", "RoPE compiled by Inductor"),
    "loss": (("mnb.megatron.loss_kernels",), "loss in mnb's Triton kernels", "loss compiled by Inductor"),
    "own": (("mnb.megatron.norm_kernels", "mnb.megatron.swiglu_kernels", "mnb.megatron.rope_kernels",
             "mnb.megatron.loss_kernels"), "every fused op in mnb's Triton kernels",
            "torch's RMSNorm, loss, RoPE and SwiGLU compiled by Inductor"),
}


def switch_rows(bench: "Bench", pool, section: str, models: str, order: str) -> None:
    """Rows of each ``preset:mbs`` in ``models`` with the section's ``enabled`` switches as ``order`` says (on/off),
    in one pool whose presets' kernels compiled first; the switches are left on.  A row's model built with a
    kernel switched off compiles Inductor's instead; ``train_row`` waits for that before its steps."""
    modules, on_note, off_note = SWITCHES[section]
    pool.run(WAIT_FOR_KERNELS)
    switch = "".join(f"import {module}\n{module}.enabled = {{0}}\n" for module in modules)
    for preset, mbs in ((m.split(":")[0], int(m.split(":")[1])) for m in models.split(",")):
        for on in (o == "on" for o in order.split(",")):
            bench.train_row(pool, section, preset, mbs, before=switch.format(on), note=on_note if on else off_note)
    pool.run(switch.format(True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="h200-out")
    parser.add_argument("--sections", default="start,think,mfu,profile,plain")
    for section in SWITCHES:
        parser.add_argument(f"--{section}-models", default="llama-1b:16,llama-3b:8",
                            help=f"{section} section: preset:mbs,...")
        parser.add_argument(f"--{section}-order", default="on,off", help=f"{section} section: each model's rows, on/off")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mnb-cold-cache-")  # an empty compile cache
    bench = Bench(out)
    from mnb.controller import Pool

    pool = None
    if "start" in sections:
        pool = bench.fresh_pool("first on this machine, empty compile cache")
        pool.stop()
        cold = plain_torchrun(out, nproc=1, layout="tp=1", steps=1, mbs=4, gbs=4,
                              extra=("--num-layers", "8", "--no-fusions"))
        bench.add("start", {"pool": "cold torchrun, Megatron's own ops (no compile)", **cold})
        pool = bench.fresh_pool("second on this machine, compile cache filled")
        start = time.perf_counter()
        pool.run("model = mnb.gpt('llama-1b', num_layers=8, seq_length=2048, seed=2)\n"
                 "mnb.train(model, steps=1, micro_batch_size=4, global_batch_size=4, bf16=True)")
        bench.add("start", {"pool": "new model in the warm pool", "new_model_to_first_step_s":
                            round(time.perf_counter() - start, 2)})
    if "think" in sections:  # empty compile cache again: the background compile while the user types
        os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mnb-cold-cache-")
        pool = bench.fresh_pool("empty compile cache, first cell 12 s after ready", think_s=12.0)
    pool = pool or Pool.start(1, gpus=[0], timeout=600)
    if "mfu" in sections:
        for preset, mbs in (("llama-1b", 8), ("llama-1b", 16), ("llama-3b", 4), ("llama-3b", 8)):
            bench.train_row(pool, "mfu", preset, mbs)
        for preset, mbs in (("llama-1b", 8), ("llama-3b", 4)):  # llama-3b unfused at mbs 8: out of memory
            bench.train_row(pool, "mfu", preset, mbs, model_kw="fusions=False")
    for section in SWITCHES:
        if section in sections:
            switch_rows(bench, pool, section, getattr(args, f"{section}_models"), getattr(args, f"{section}_order"))
    if "adam" in sections:
        bench.train_row(pool, "mfu", "llama-1b", 8, note="mnb's fused Adam step")
        bench.train_row(pool, "mfu", "llama-1b", 8, note="Megatron's foreach Adam step",
                        before="import mnb.megatron.train as _t; _fused = _t._use_fused_adam; "
                               "_t._use_fused_adam = lambda inner: None\n")
        pool.run("_t._use_fused_adam = _fused")
    if "profile" in sections:
        for preset in ("llama-1b", "llama-3b"):
            bench.profile(pool, preset, 8)
    pool.stop()
    if "plain" in sections:
        plain = plain_torchrun(out, nproc=1, layout="tp=1", steps=STEPS, mbs=8, gbs=64)
        bench.add("plain", {"job": f"llama-1b mbs 8 gbs 64, {STEPS} steps, plain torchrun", **plain})
    lines = []
    for section, rows in bench.rows.items():
        lines.append(f"## {section}\n")
        for row in rows:
            lines.append("- " + json.dumps(row, default=str))
        lines.append("")
    (out / "h200_limits.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
