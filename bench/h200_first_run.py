"""A fresh pool's first run on one H200 with an empty compile cache: peak memory per step, unfused
(while the fused kernels compile in the background) and fused, against ``mnb.estimate.memory`` (issue 39).

    python bench/h200_first_run.py --out OUTDIR        # writes OUTDIR/h200_first_run.json
    python bench/h200_first_run.py --llama-1b --out OUTDIR

1. The first cell of a fresh pool, empty compile caches (``XDG_CACHE_HOME``, ``TORCHINDUCTOR_CACHE_DIR``
   and ``TRITON_CACHE_DIR`` new folders): ``mnb.gpt('llama-3b', seq_length=2048)``,
   4 steps at micro batch 8, global batch 64, bf16 (the cell that ran out of memory at step 2).
2. llama-1b, micro batch 8, in the same pool with its compile held back (the ranks hold
   ``fusions._warm_lock``), so all 4 steps run unfused (steps 2-4 with Adam's state), then 3 more
   steps with the compiled kernels.
3. The wait: llama-1b with a new SwiGLU width (its compile held 10 s) and ``FIT_FRACTION`` at 0.3,
   so step 1's measured need does not "fit": step 2 waits for the kernels and runs fused.

Rows 2 and 3 (and ``--llama-1b``'s second) measure the fallback for a rank where mnb's own Triton kernels
do not run (their probe failed): they switch the four kernel modules off (``UNFUSED_PATH``) before building
the model, since with them on a model has nothing to compile, and so nothing to hold or wait for (the rows
of 2026-12-05 in BENCHMARKS.md ran fused throughout for that reason).

Each row: the step, whether it ran unfused, the allocator's peak of that step, and the estimates
(``fused_loss`` as on CUDA ranks: what ``mnb.last_run.predicted_memory`` shows; and what
``%mnb plan``'s ``mnb.estimate.plan`` assumes).  Uses the pool API (no IPython on the device machine).
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

from gpu_measure import GIB, Rows  # noqa: E402


KERNELS = ("norm_kernels", "swiglu_kernels", "rope_kernels", "loss_kernels")
UNFUSED_PATH = "".join(f"from mnb.megatron import {m}\n{m}.enabled = False\n" for m in KERNELS)
"""Cell lines that leave a model built after them to Inductor's compiled kernels (the path that compiles)."""
OWN_KERNELS = UNFUSED_PATH.replace("False", "True")


def step_rows(bench: Rows, label: str, run, plan_bytes: float) -> None:
    rec = run.ranks[0]
    predicted = run.predicted_memory.peak_bytes
    for row in rec["steps"]:
        bench.add("steps", {"job": label, "step": row["step"], "unfused": bool(row.get("compiling")),
                            "peak_GiB": round(row["mem_peak_bytes"] / GIB, 2),
                            "estimate_GiB": round(predicted / GIB, 2), "plan_GiB": round(plan_bytes / GIB, 2),
                            "step_s": round(row["step_time_s"], 2),
                            "waited_s": row.get("waited_for_kernels_s") and round(row["waited_for_kernels_s"], 2)})
    bench.add("summary", {"job": label, "text": run.summary()})


def plan_bytes(preset: str, mbs: int, gbs: int) -> float:
    import mnb.estimate as est
    from mnb.config import ParallelConfig, TrainConfig, model_config

    model = model_config(preset, seq_length=2048)
    return est.memory(model, ParallelConfig(), TrainConfig(bf16=True, micro_batch_size=mbs,
                                                          global_batch_size=gbs), gpus=1).peak_bytes


def llama_1b(bench: Rows, pool) -> None:
    """``--llama-1b``: llama-1b's first cell in a fresh pool, then a llama-1b of a new SwiGLU width
    (not among the kernels the pool compiles for the presets when it is ready) with its compile held:
    every step unfused, steps 2-4 with Adam's state."""
    import mnb

    for label, cell in (
        ("llama-1b mbs 8 gbs 64, first cell", "model = mnb.gpt('llama-1b', seq_length=2048)\n"
         "mnb.train(model, steps=4, micro_batch_size=8, global_batch_size=64, bf16=True)"),
        ("llama-1b ffn 7936 mbs 8 gbs 64, compile held: unfused",
         "model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()\n"
         "from mnb.megatron import fusions\nfusions._warm_lock.acquire()\n" + UNFUSED_PATH +
         "model = mnb.gpt('llama-1b', seq_length=2048, ffn_hidden_size=7936)\n"
         "try:\n    mnb.train(model, steps=4, micro_batch_size=8, global_batch_size=64, bf16=True)\n"
         "finally:\n    fusions._warm_lock.release()\n" + OWN_KERNELS),
    ):
        try:
            pool.run(cell)
            step_rows(bench, label, mnb.last_run, plan_bytes("llama-1b", 8, 64))
        except Exception:
            bench.add("error", {"job": label, "error": traceback.format_exc()[-2500:]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="h200-out")
    parser.add_argument("--llama-1b", action="store_true", help="llama-1b's first cell and unfused steps only")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cold = tempfile.mkdtemp(prefix="mnb-cold-cache-")
    os.environ["XDG_CACHE_HOME"] = cold
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cold, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cold, "triton")  # mnb's own kernels built from nothing too
    bench = Rows(out, "h200_first_run.json")
    import mnb
    from mnb.controller import Pool

    t0 = time.perf_counter()
    pool = Pool.start(1, gpus=[0], timeout=600)
    bench.add("start", {"ready_s": round(time.perf_counter() - t0, 2)})
    if args.llama_1b:
        llama_1b(bench, pool)
        pool.stop()
        return
    try:
        pool.run("model = mnb.gpt('llama-3b', seq_length=2048)\n"
                 "mnb.train(model, steps=4, micro_batch_size=8, global_batch_size=64, bf16=True)")
        step_rows(bench, "llama-3b mbs 8 gbs 64, first cell", mnb.last_run, plan_bytes("llama-3b", 8, 64))
    except Exception:
        bench.add("error", {"job": "llama-3b first cell", "error": traceback.format_exc()[-2500:]})
    try:
        pool.run("model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()\n"
                 "from mnb.megatron import fusions, background_compile\n"
                 "fusions._warm_lock.acquire()\n" + UNFUSED_PATH +
                 "model = mnb.gpt('llama-1b', seq_length=2048)\n"
                 "try:\n"
                 "    mnb.train(model, steps=4, micro_batch_size=8, global_batch_size=64, bf16=True)\n"
                 "finally:\n"
                 "    fusions._warm_lock.release()")
        step_rows(bench, "llama-1b mbs 8 gbs 64, compile held: unfused", mnb.last_run, plan_bytes("llama-1b", 8, 64))
        pool.run("p = background_compile.pending()\nassert p is None or p.wait(300)\n"
                 "mnb.train(model, steps=3)\n" + OWN_KERNELS)
        step_rows(bench, "llama-1b mbs 8 gbs 64, compiled", mnb.last_run, plan_bytes("llama-1b", 8, 64))
    except Exception:
        bench.add("error", {"job": "llama-1b", "error": traceback.format_exc()[-2500:]})
    try:  # the wait: a GPU share of 30 % makes llama-1b's unfused step "not fit"; the compile is held 10 s
        pool.run("model = None\nimport gc, threading; gc.collect(); torch.cuda.empty_cache()\n"
                 "background_compile.FIT_FRACTION = 0.3\n"
                 "fusions._warm_lock.acquire()\n" + UNFUSED_PATH +
                 "model = mnb.gpt('llama-1b', seq_length=2048, ffn_hidden_size=7168)\n"
                 "threading.Timer(10, fusions._warm_lock.release).start()\n"
                 "try:\n"
                 "    mnb.train(model, steps=3, micro_batch_size=8, global_batch_size=64, bf16=True)\n"
                 "finally:\n"
                 "    background_compile.FIT_FRACTION = 0.95\n" + "".join("    " + line + "\n" for line in OWN_KERNELS.splitlines()))
        step_rows(bench, "llama-1b ffn 7168 mbs 8, FIT_FRACTION 0.3: waits", mnb.last_run,
                  plan_bytes("llama-1b", 8, 64))
    except Exception:
        bench.add("error", {"job": "wait", "error": traceback.format_exc()[-2500:]})
    pool.stop()


if __name__ == "__main__":
    main()
