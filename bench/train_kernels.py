"""RMSNorm and SwiGLU of a training step on one GPU: torch's eager ops, Inductor's compiled kernels and mnb's
Triton kernels (``mnb.megatron.norm_kernels``, ``mnb.megatron.swiglu_kernels``), forward alone and forward +
backward, against the copy bandwidth.

    python bench/train_kernels.py --out OUTDIR        # OUTDIR/train_kernels.json and .md; about two minutes

Shapes, bf16, seq 2048: the norms' inputs of llama-1b (hidden 2048) at micro batch 8 and 16, of llama-3b
(hidden 3072) and llama-8b (hidden 4096) at micro batch 8 and 4; SwiGLU's inputs (``[tokens, 2 x ffn]``)
of llama-1b/3b (ffn 8192) at micro batch 8 and llama-8b (ffn 14336) at micro batch 4.  Each side is timed
alone on the GPU (CUDA events, median of 20 calls after 5), with the same output gradient each call; the
bytes a pass must move at least (RMSNorm forward: read x, write y; backward: read x and the output
gradient, write the input gradient; SwiGLU forward: read 2f, write f; backward: read f and 2f, write 2f,
per token) over the time is its bandwidth, beside ``x.clone()``'s.  Every side's output and gradients are
checked against fp32 (largest error relative to the largest value).  ``PROGRAMS_PER_SM`` of the norm's
backward is swept for mnb's side.  ``--device cpu`` (with ``TRITON_INTERPRET=1``, tiny shapes, wall-clock
timing) is a dry run of the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mnb.megatron import fusions, norm_kernels, swiglu_kernels  # noqa: E402

SHAPES = {"llama-1b mbs 8": (16384, 2048), "llama-1b mbs 16": (32768, 2048), "llama-3b mbs 8": (16384, 3072),
          "llama-8b mbs 4": (8192, 4096)}
SWIGLU_SHAPES = {"llama-1b/3b mbs 8": (16384, 8192), "llama-8b mbs 4": (8192, 14336)}
"""(tokens, ffn): SwiGLU's input is [tokens, 2 x ffn]."""
EPS = 1e-5


DEVICE = "cuda"


def timed(fn, repeats: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` on the GPU (wall clock for a CPU dry run)."""
    if DEVICE != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sides():
    compiled = torch.compile(lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS), dynamic=False)
    return {
        "torch F.rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
        "Inductor (torch.compile)": compiled,
        "mnb's Triton kernels": lambda x, w: norm_kernels.rms_norm(x, w, EPS),
    }


def errors(norm, x, w, dy) -> dict:
    exact_x = x.detach().float().requires_grad_()
    exact_w = w.detach().float().requires_grad_()
    exact = F.rms_norm(exact_x, (x.shape[-1],), exact_w, EPS)
    exact.backward(dy.float())
    got_x, got_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    got = norm(got_x, got_w)
    got.backward(dy)

    def relative(a, b):
        return float((a.float() - b).abs().max() / b.abs().max())

    return {"y_error": relative(got, exact.detach()), "dx_error": relative(got_x.grad, exact_x.grad),
            "dw_error": relative(got_w.grad, exact_w.grad)}


def measure(label: str, rows: int, width: int) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(rows + width)
    x = torch.randn(rows, width, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    w = (1 + 0.1 * torch.randn(width, device=DEVICE, generator=gen)).to(torch.bfloat16)
    dy = torch.randn(rows, width, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    size = x.numel() * x.element_size()
    copy_ms = timed(lambda: x.clone())
    out = [{"shape": f"RMSNorm {label}", "side": "x.clone() (copy bandwidth)", "forward_ms": round(copy_ms, 4),
            "forward_GBps": round(2 * size / copy_ms / 1e6, 1)}]
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def both(norm):
        def step():
            xg.grad = wg.grad = None
            norm(xg, wg).backward(dy)
        return step

    for name, norm in sides().items():
        row = {"shape": f"RMSNorm {label}", "side": name}
        try:
            with torch.no_grad():
                forward_ms = timed(lambda: norm(x, w))
            both_ms = timed(both(norm))
            row.update(forward_ms=round(forward_ms, 4), forward_GBps=round(2 * size / forward_ms / 1e6, 1),
                       forward_backward_ms=round(both_ms, 4),
                       forward_backward_GBps=round(5 * size / both_ms / 1e6, 1), **errors(norm, x, w, dy))
        except Exception:  # noqa: BLE001 - a side that fails is a row that says so
            row["error"] = traceback.format_exc()[-1200:]
        out.append(row)
    for per_sm in (1, 2, 4, 8, 16):
        norm_kernels.PROGRAMS_PER_SM = per_sm
        norm_kernels._programs_on.cache_clear()
        try:
            ms = timed(both(sides()["mnb's Triton kernels"]))
            out.append({"shape": f"RMSNorm {label}", "side": f"mnb, {per_sm} backward programs per SM",
                        "forward_backward_ms": round(ms, 4), "forward_backward_GBps": round(5 * size / ms / 1e6, 1)})
        except Exception:  # noqa: BLE001
            out.append({"shape": f"RMSNorm {label}", "side": f"mnb, {per_sm} per SM",
                        "error": traceback.format_exc()[-1200:]})
    norm_kernels.PROGRAMS_PER_SM = 4
    norm_kernels._programs_on.cache_clear()
    return out


def swiglu_sides():
    return {
        "torch eager (silu(gate) * up)": lambda y: fusions._swiglu(y),
        "Inductor (mnb.megatron.fusions)": lambda y: fusions.swiglu(y, compiled=True),
        "mnb's Triton kernels": swiglu_kernels.swiglu,
    }


def measure_swiglu(label: str, tokens: int, ffn: int) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(tokens + ffn)
    y = torch.randn(tokens, 2 * ffn, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    g = torch.randn(tokens, ffn, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    half = g.numel() * g.element_size()
    exact = fusions._swiglu(y.float())
    exact_grad = fusions._swiglu_grad(g.float(), y.float())
    out = []
    yg = y.clone().requires_grad_()

    def both(fn):
        def step():
            yg.grad = None
            fn(yg).backward(g)
        return step

    for name, fn in swiglu_sides().items():
        row = {"shape": f"SwiGLU {label}", "side": name}
        try:
            with torch.no_grad():
                forward_ms = timed(lambda: fn(y))
            both_ms = timed(both(fn))
            yg.grad = None
            got = fn(yg)
            got.backward(g)
            row.update(forward_ms=round(forward_ms, 4), forward_GBps=round(3 * half / forward_ms / 1e6, 1),
                       forward_backward_ms=round(both_ms, 4),
                       forward_backward_GBps=round(8 * half / both_ms / 1e6, 1),
                       y_error=float((got.float() - exact).abs().max() / exact.abs().max()),
                       dx_error=float((yg.grad.float() - exact_grad).abs().max() / exact_grad.abs().max()))
        except Exception:  # noqa: BLE001 - a side that fails is a row that says so
            row["error"] = traceback.format_exc()[-1200:]
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="train-kernels-out")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = SHAPES if DEVICE == "cuda" else {"dry run": (64, 96)}
    swiglu_shapes = SWIGLU_SHAPES if DEVICE == "cuda" else {"dry run": (64, 48)}
    rows = [{"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
             "norm_kernels_run": norm_kernels.runs_on(torch.device(DEVICE)),
             "swiglu_kernels_run": swiglu_kernels.runs_on(torch.device(DEVICE))}]
    for label, (tokens, width) in shapes.items():
        rows += measure(label, tokens, width)
        (out / "train_kernels.json").write_text(json.dumps(rows, indent=1))
    for label, (tokens, ffn) in swiglu_shapes.items():
        rows += measure_swiglu(label, tokens, ffn)
        (out / "train_kernels.json").write_text(json.dumps(rows, indent=1))
    columns = ("shape", "side", "forward_ms", "forward_GBps", "forward_backward_ms", "forward_backward_GBps",
               "y_error", "dx_error", "dw_error", "error")
    lines = [json.dumps(rows[0]), "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows[1:]:
        lines.append("| " + " | ".join(str(row.get(c, "")).replace("\n", " ")[:200] for c in columns) + " |")
    (out / "train_kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
