"""Predicted vs measured memory per component for llama-1b on one GPU, with and without mnb's fused kernels.

    PYTHONPATH=. python bench/gpu_memory_components.py --out OUTDIR [--mbs 8] [--gbs 64] [--steps 12]

Through the pool, as a user runs it: ``mnb.gpt('llama-1b', fusions=...)`` then
``mnb.train(..., bf16=True)``; the rank counts its tensors by component
(``run.measured_memory``: weights, gradients, optimizer, activations saved for
backward; ``peak`` is the CUDA allocator's) and ``run.predicted_components``
gives the estimator's.  Writes gpu_memory_components.{json,md}; the md table
goes into BENCHMARKS.md.  Tokens/s is recorded too, to see what counting the
saved tensors costs (compare BENCHMARKS.md's earlier rows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mnb.controller import Pool, last_run

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "peak")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mbs", type=int, default=8)
    parser.add_argument("--gbs", type=int, default=64, help="global batch (64 = 8 microbatches: the MFU table's job)")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pool = Pool.start(1, device="cuda", timeout=300)
    rows = []
    try:
        for fusions in (True, False):
            pool.run(f"model = mnb.gpt('llama-1b', fusions={fusions})\n"
                     f"mnb.train(model, steps={args.steps}, micro_batch_size={args.mbs}, "
                     f"global_batch_size={args.gbs}, bf16=True)\n"
                     "del model\nimport gc; gc.collect(); torch.cuda.empty_cache()", quiet=True)
            run = last_run()
            measured, predicted = run.measured_memory[0], run.predicted_components(0)
            tps = [t for t in run.tokens_per_s[1:] if t]
            mfu = [m for m in run.mfu[1:] if m is not None]
            for name in COMPONENTS:
                rows.append({"fusions": fusions, "component": name, "predicted_gib": predicted[name] / 2**30,
                             "measured_gib": measured[name] / 2**30,
                             "error": predicted[name] / measured[name] - 1 if measured[name] else None})
            rows.append({"fusions": fusions, "component": "tokens/s (steps 2-N)", "measured": sum(tps) / len(tps),
                         "mfu_datasheet": sum(mfu) / len(mfu), "peak_source": run.peak_source,
                         "per_step": [round(t) for t in run.tokens_per_s]})
            print("tokens/s per step (saved tensors counted in steps 1-2):", [round(t) for t in run.tokens_per_s])
        # the same steady state with the saved-tensor hooks in every step: what counting costs
        pool.run("import mnb.megatron.memory as _m\n_m.ComponentMeter.COUNTED_STEPS = 10**9\n"
                 f"model = mnb.gpt('llama-1b')\nmnb.train(model, steps={args.steps}, micro_batch_size={args.mbs}, "
                 f"global_batch_size={args.gbs}, bf16=True)", quiet=True)
        print("tokens/s per step, saved tensors counted in every step:", [round(t) for t in last_run().tokens_per_s])
    finally:
        pool.stop()
    (out / "gpu_memory_components.json").write_text(json.dumps(rows, indent=1))
    lines = ["| fusions | component | predicted GiB | measured GiB | predicted / measured - 1 |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "measured_gib" in r:
            err = "n/a" if r["error"] is None else f"{r['error']:+.1%}"
            lines.append(f"| {'on' if r['fusions'] else 'off'} | {r['component']} | {r['predicted_gib']:.2f} | "
                         f"{r['measured_gib']:.2f} | {err} |")
        else:
            lines.append(f"| {'on' if r['fusions'] else 'off'} | tokens/s (steps 2-N) | | {r['measured']:,.0f} | "
                         f"MFU {r['mfu_datasheet']:.1%} vs {r['peak_source']} |")
    (out / "gpu_memory_components.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
