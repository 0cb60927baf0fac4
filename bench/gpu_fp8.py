"""FP8 linears on the local spec against bf16 on one GPU (issue 39 part 4): every check in one run.

    python bench/gpu_fp8.py --out OUTDIR [--sections gemm,cast,loss,speed,profile] [--recipes bf16,delayed]
    # OUTDIR/gpu_fp8.json, .md; --recipes keeps only those rows of the plan (default: all)

1. ``gemm``: the GEMM peak, bf16 ``torch.matmul`` against ``torch._scaled_mm`` (E4M3, tensorwise and
   rowwise scales), for square sizes and llama linears at 16,384 tokens: the FP8 peak the estimator uses.
2. ``loss``: 200 steps of a 4-layer llama-1b shape (seq 1024, mbs 4, one microbatch, stdlib text) in
   bf16, tensorwise and rowwise, same initial weights and data: the loss curves and the end loss (mean
   of the last 10 steps), which must agree within 1 %.
3. ``linears``: after the FP8 run, each FP8 linear's output on the model's own activations against a
   bf16 matmul of the same input and weight (relative RMS error; E4M3's unit roundoff is 2^-4).
4. ``speed``: tokens/s of llama-1b, llama-3b and a 20-layer llama-8b shape (seq 2048), bf16 against
   each recipe: 1 warm-up step (the casts compile), then 3 measured steps (mean of the last 2), with
   mnb's fused kernels compiled first.
5. ``cast`` (not in the default sections): ``fp8="delayed"``'s cast kernel (mnb.megatron.fp8_delayed) on
   llama shapes against the same arithmetic as torch ops (bytes that differ: 0 expected, both round to
   nearest even) and, by GPU time from torch's profiler, against tensorwise's compiled amax + cast.
6. ``profile`` (not in the default sections): one llama-3b step (mbs 4, 4 microbatches) in bf16 and in
   tensorwise FP8 under torch's profiler after a warm-up step: GPU time by kernel group and the top
   kernels (bench/kernel_profile.py), ``OUTDIR/fp8_profile_<recipe>.json``: where the FP8 step's time goes
   beside the GEMMs it speeds up.

Uses the pool API (the device machine has no IPython; ``%mnb`` calls the same methods).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu_measure import Rows  # noqa: E402

RECIPES = (None, "tensorwise", "rowwise", "delayed")
LOSS_STEPS = 200
SPEED = (("llama-1b", "", 8, 32), ("llama-3b", "", 4, 16), ("llama-8b", "num_layers=20", 2, 8))
"""(preset, overrides, micro batch, global batch): 4 microbatches a step, seq 2048 (one H200; ``--shapes``
for a smaller card, e.g. an H100's ``llama-1b::8:32,llama-3b::2:8,llama-8b:num_layers=8:1:4``)."""


def parse_shapes(text: str) -> tuple:
    """``preset:overrides:mbs:gbs,...`` (three of them: the 1B, 3B and 8B rows) as :data:`SPEED`'s tuples."""
    shapes = []
    for item in text.split(","):
        preset, overrides, mbs, gbs = item.split(":")
        shapes.append((preset, overrides, int(mbs), int(gbs)))
    if len(shapes) != 3:
        raise SystemExit(f"--shapes takes three shapes (1B, 3B, 8B rows), got {len(shapes)}")
    return tuple(shapes)


def after_failure(pool) -> None:
    """A failed row (out of memory on a smaller card) must not leave the next row less memory: a fresh pool
    (whether a failed cell gives its memory back is bench/gpu_oom_probe.py's question)."""
    try:
        pool.restart()
    except Exception as exc:  # the next rows say what is wrong
        print("the pool did not restart:", exc, flush=True)


def error_line(exc: BaseException) -> str:
    """A failed row's cause in one line: the rank's error line of a pool error, else the exception's last."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    rank_lines = [line for line in lines if line.startswith("[r")]
    text = (rank_lines or lines or [type(exc).__name__])[0]
    return f"{type(exc).__name__}: {text}"[:400]


def gemm_rows(bench: Rows) -> None:
    import torch

    from mnb.megatron import fp8

    def timed(fn, flops: float) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        n, t0 = 20, time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return flops * n / (time.perf_counter() - t0) / 1e12

    shapes = [("square 8192", 8192, 8192, 8192), ("1b fc1 (16k tokens)", 16384, 16384, 2048),
              ("8b fc1 (16k tokens)", 16384, 28672, 4096)]
    for label, m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        flops = 2 * m * n * k
        row = {"gemm": label, "m": m, "n": n, "k": k, "bf16_tflops": round(timed(lambda: a @ b.t(), flops))}
        for name in ("tensorwise", "rowwise"):
            rc = fp8.recipe(name)
            ad, asc = fp8._cast_eager(a, fp8.E4M3, rc.axis(-1), rc.pow2)
            bd, bsc = fp8._cast_eager(b, fp8.E4M3, rc.axis(-1), rc.pow2)
            row[f"{name}_tflops"] = round(timed(lambda: fp8.scaled_mm(ad, asc, bd.t(), bsc.t(), torch.bfloat16,
                                                                      fast_accum=True), flops))
            if label.startswith("1b"):  # the casts of both operands at every call, compiled
                row[f"{name}_with_casts_tflops"] = round(timed(lambda: fp8.scaled_mm(
                    *fp8.cast(a, fp8.E4M3, rc.axis(-1), rc.pow2), *(lambda d, s: (d.t(), s.t()))(
                        *fp8.cast(b, fp8.E4M3, rc.axis(-1), rc.pow2)), torch.bfloat16, fast_accum=True), flops))
        bench.add("gemm", row)
        del a, b
    torch.cuda.empty_cache()


def train_cell(preset: str, model_kw: str, recipe: str | None, seq: int, *, seed: int = 1234) -> str:
    kw = ", ".join(x for x in (model_kw, f"fp8={recipe!r}" if recipe else "") if x)
    return ("model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()\n"
            f"model = mnb.gpt({preset!r}, seq_length={seq}, seed={seed}{', ' + kw if kw else ''})\n"
            "from mnb.megatron import background_compile as _bc\n"
            "_c = _bc.pending()\n_c is not None and _c.wait(300)\n")


LINEAR_CHECK = '''
import torch
from mnb.megatron import fp8 as _fp8
_errors = {}
def _hook(name):
    def hook(module, args, output):
        x = args[0]
        ref = (x.reshape(-1, x.shape[-1]) @ module.weight.t()).float()
        got = output[0].reshape(-1, ref.shape[-1]).float()
        _errors[name] = ((got - ref).norm() / ref.norm()).item()
    return hook
_handles = [m.register_forward_hook(_hook(n)) for n, m in model.chunks[0].named_modules() if getattr(m, "fp8_recipe", None)]
with torch.no_grad():
    mnb.evaluate(model, data="stdlib", batches=1, micro_batch_size=4)
for h in _handles:
    h.remove()
'''


def loss_row(bench: Rows, pool, recipe: str | None, curves: dict) -> None:
    import mnb

    label = recipe or "bf16"
    try:
        pool.run(train_cell("llama-1b", "num_layers=4", recipe, 1024)
                 + f"mnb.train(model, steps={LOSS_STEPS}, micro_batch_size=4, global_batch_size=4, bf16=True, "
                   "data='stdlib', lr=3e-4, warmup_steps=20, log_every=50)", timeout=600)
        losses = list(mnb.last_run.losses)
        curves[label] = losses
        (bench.out / "fp8_loss_curves.json").write_text(json.dumps(curves))
        end = sum(losses[-10:]) / 10
        row = {"recipe": label, "first_loss": round(losses[0], 4), "loss_at_50": round(losses[49], 4),
               "loss_at_100": round(losses[99], 4), "end_loss_mean_last10": round(end, 4)}
        if "bf16" in curves and recipe is not None:
            row["end_vs_bf16"] = round(end / (sum(curves["bf16"][-10:]) / 10) - 1, 4)
        bench.add("loss", row)
        if recipe is not None:
            pool.run(LINEAR_CHECK)
            errors = pool.pull("_errors")[0]
            bench.add("linears", {"recipe": label, "linears": len(errors), "max_rel_err": round(max(errors.values()), 4),
                                  "mean_rel_err": round(sum(errors.values()) / len(errors), 4),
                                  "per_linear": {k: round(v, 4) for k, v in errors.items()}})
    except Exception as exc:
        bench.add("loss", {"recipe": label, "error": error_line(exc)})
        after_failure(pool)


def speed_row(bench: Rows, pool, shape: tuple, recipe: str | None, base: dict) -> None:
    import mnb

    preset, model_kw, mbs, gbs = shape
    label = f"{preset}{' ' + model_kw if model_kw else ''} mbs {mbs} gbs {gbs} {recipe or 'bf16'}"
    try:
        pool.run(train_cell(preset, model_kw, recipe, 2048)
                 + f"mnb.train(model, steps=1, micro_batch_size={mbs}, global_batch_size={gbs}, bf16=True)\n"
                   f"mnb.train(model, steps=3, micro_batch_size={mbs}, global_batch_size={gbs}, bf16=True)",
                 timeout=600)
        run = mnb.last_run
        tokens = [x for x in run.tokens_per_s[1:] if x]
        tps = sum(tokens) / len(tokens)
        peak = max(rec["memory"]["peak_allocated_bytes"] for rec in run.ranks.values()) / 2**30
        row = {"model": label, "tokens_per_s": round(tps), "peak_GiB": round(peak, 1),
               "unfused_steps": len(run.unfused_steps)}
        if recipe == "delayed":  # which path cast: mnb's kernel, or torch's ops where its probe failed
            row["delayed_casts"] = pool.run("from mnb.megatron import fp8_delayed\ndict(fp8_delayed.calls)")[0]
        if recipe is None:
            base[preset] = tps
        elif preset in base:
            row["vs_bf16"] = round(tps / base[preset], 3)
        bench.add("speed", row)
    except Exception as exc:
        bench.add("speed", {"model": label, "error": error_line(exc)})
        after_failure(pool)


def profile_row(bench: Rows, pool, shape: tuple, recipe: str | None) -> None:
    preset, model_kw, mbs, gbs = shape
    label = f"{preset}{' ' + model_kw if model_kw else ''} mbs {mbs} gbs {gbs} {recipe or 'bf16'}"
    try:
        pool.run(train_cell(preset, model_kw, recipe, 2048)
                 + f"mnb.train(model, steps=1, micro_batch_size={mbs}, global_batch_size={gbs}, bf16=True)\n"
                 f"import sys\nsys.path.insert(0, {str(HERE)!r})\nfrom kernel_profile import profile_step\n"
                 f"profile = profile_step(model, micro_batch_size={mbs}, global_batch_size={gbs}, bf16=True)",
                 timeout=600)
        profile = pool.pull("profile")[0]
        (bench.out / f"fp8_profile_{recipe or 'bf16'}.json").write_text(json.dumps(profile, indent=1))
        bench.add("profile", {"model": label, "step_wall_s": profile["wall_s"], "busy_share": profile["busy_share"],
                              **{f"{k}_s": v for k, v in profile["groups_s"].items()},
                              "top_kernels": profile["top_kernels"][:12]})
    except Exception as exc:
        bench.add("profile", {"model": label, "error": error_line(exc)})
        after_failure(pool)


def cast_rows(bench: Rows) -> None:
    """The delayed cast kernel against torch's ops (the same history) and against tensorwise's compiled cast."""
    import torch

    from mnb.megatron import fp8, fp8_delayed

    def gpu_ms(fn, n=20) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        return sum(e.device_time_total for e in prof.key_averages()) / n / 1e3

    for tokens, width in ((16384, 2048), (16384, 3072), (16384, 8192)):
        x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16) * 3
        for dtype in (fp8.E4M3, fp8.E5M2):
            kernel, by_torch = fp8_delayed.AmaxHistory(), fp8_delayed.AmaxHistory()
            differ = 0
            for _ in range(3):
                a = fp8_delayed.cast(x, dtype, kernel, transposed=True)
                by_torch.prepare(x)
                b = fp8_delayed._cast_torch(x, dtype, by_torch, True, True)
                by_torch.calls += 1
                differ += int((a[0].view(torch.uint8) != b[0].view(torch.uint8)).sum())
                differ += int((a[1].view(torch.uint8) != b[1].view(torch.uint8)).sum()) + int(a[2] != b[2])
                x = x * 1.5
            history = fp8_delayed.AmaxHistory()
            bench.add("cast", {
                "shape": f"{tokens}x{width}", "dtype": str(dtype).split(".")[-1], "bytes_differ": differ,
                "kernel_calls": fp8_delayed.calls["kernel"],
                "delayed_ms": round(gpu_ms(lambda: fp8_delayed.cast(x, dtype, history, transposed=True)), 4),
                "tensorwise_compiled_ms": round(gpu_ms(lambda: fp8.cast_layouts(x, dtype, None, False,
                                                                                  transposed=True)), 4),
                "copy_ms": round(gpu_ms(lambda: x.clone()), 4)})  # the cast's bytes: reads 2 B, writes 1 + 1 B an element


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fp8-out")
    parser.add_argument("--sections", default="gemm,loss,speed")
    parser.add_argument("--recipes", default=",".join(r or "bf16" for r in RECIPES),
                        help="rows of these recipes only (bf16 included where a row compares)")
    parser.add_argument("--shapes", default=None, help="the speed rows' shapes, preset:overrides:mbs:gbs x 3 "
                        "(default: SPEED, sized for one H200)")
    args = parser.parse_args()
    recipes = {None if r == "bf16" else r for r in args.recipes.split(",")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    bench = Rows(out, "gpu_fp8.json")
    import torch

    import mnb

    bench.add("versions", {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                           "megatron_core": __import__("megatron.core").core.__version__,
                           "torchao": __import__("torchao").__version__, "mnb": mnb.__version__})
    if "gemm" in sections:
        try:
            gemm_rows(bench)
        except Exception:
            bench.add("gemm", {"error": traceback.format_exc()[-1500:]})
    if "cast" in sections:
        try:
            cast_rows(bench)
        except Exception:
            bench.add("cast", {"error": traceback.format_exc()[-1500:]})
    from mnb.controller import Pool

    pool = Pool.start(1, gpus=[0], timeout=600)
    try:
        # by priority, so that a call cut short keeps the rows that matter most
        curves, base = {}, {}
        one, three, eight = parse_shapes(args.shapes) if args.shapes else SPEED
        plan = [("loss", None), ("loss", "tensorwise"), ("speed", (three, None)), ("speed", (three, "tensorwise")),
                ("profile", (three, "tensorwise")), ("profile", (three, None)),
                ("speed", (eight, None)), ("speed", (eight, "tensorwise")), ("speed", (one, None)),
                ("speed", (one, "tensorwise")), ("loss", "rowwise"), ("speed", (three, "rowwise")),
                ("speed", (eight, "rowwise")), ("speed", (one, "rowwise"))]
        plan[4:4] = [("speed", (three, "delayed")), ("profile", (three, "delayed")), ("loss", "delayed"),
                     ("speed", (eight, "delayed")), ("speed", (one, "delayed"))]
        for section, what in plan:
            recipe = what[1] if isinstance(what, tuple) else what
            if section not in sections or recipe not in recipes:
                continue
            if section == "loss":
                loss_row(bench, pool, what, curves)
            elif section == "profile":
                profile_row(bench, pool, what[0], what[1])
            else:
                speed_row(bench, pool, what[0], what[1], base)
    finally:
        pool.stop()
    lines = []
    for section, rows in bench.rows.items():
        lines.append(f"\n### {section}\n")
        keys = list(dict.fromkeys(k for r in rows for k in r if k != "per_linear"))
        lines.append("| " + " | ".join(keys) + " |")
        lines.append("|" + "---|" * len(keys))
        for r in rows:
            lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    (out / "gpu_fp8.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
