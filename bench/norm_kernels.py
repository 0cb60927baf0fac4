"""RMSNorm of a training step on one GPU: torch's ``F.rms_norm``, Inductor's compiled norm and mnb's Triton
kernels (``mnb.megatron.norm_kernels``), forward alone and forward + backward, against the copy bandwidth.

    python bench/norm_kernels.py --out OUTDIR        # OUTDIR/norm_kernels.json and .md; about a minute

Shapes: the norms' inputs of llama-1b (hidden 2048) at micro batch 8 and 16 and of llama-3b (hidden 3072) and
llama-8b (hidden 4096) at micro batch 8 and 4, seq 2048, bf16.  Each side is timed alone on the GPU (CUDA
events, median of 20 calls after 5), with a fresh output gradient each call as in training; the bytes a pass
must move at least (forward: read x, write y; backward: read x and the output gradient, write the input
gradient) over the time is its bandwidth, beside ``x.clone()``'s.  Every side's output and gradients are
checked against fp32 (largest error relative to the largest value).  ``PROGRAMS_PER_SM`` of the backward
is swept for mnb's side.  ``--device cpu`` (with ``TRITON_INTERPRET=1``, tiny shapes, wall-clock timing)
is a dry run of the script itself.
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

from mnb.megatron import norm_kernels  # noqa: E402

SHAPES = {"llama-1b mbs 8": (16384, 2048), "llama-1b mbs 16": (32768, 2048), "llama-3b mbs 8": (16384, 3072),
          "llama-8b mbs 4": (8192, 4096)}
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
    out = [{"shape": label, "side": "x.clone() (copy bandwidth)", "forward_ms": round(copy_ms, 4),
            "forward_GBps": round(2 * size / copy_ms / 1e6, 1)}]
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def both(norm):
        def step():
            xg.grad = wg.grad = None
            norm(xg, wg).backward(dy)
        return step

    for name, norm in sides().items():
        row = {"shape": label, "side": name}
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
            out.append({"shape": label, "side": f"mnb, {per_sm} backward programs per SM",
                        "forward_backward_ms": round(ms, 4), "forward_backward_GBps": round(5 * size / ms / 1e6, 1)})
        except Exception:  # noqa: BLE001
            out.append({"shape": label, "side": f"mnb, {per_sm} per SM", "error": traceback.format_exc()[-1200:]})
    norm_kernels.PROGRAMS_PER_SM = 4
    norm_kernels._programs_on.cache_clear()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="norm-out")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = SHAPES if DEVICE == "cuda" else {"dry run": (64, 96)}
    rows = [{"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
             "runs_on": norm_kernels.runs_on(torch.device(DEVICE))}]
    for label, (tokens, width) in shapes.items():
        rows += measure(label, tokens, width)
        (out / "norm_kernels.json").write_text(json.dumps(rows, indent=1))
    columns = ("shape", "side", "forward_ms", "forward_GBps", "forward_backward_ms", "forward_backward_GBps",
               "y_error", "dx_error", "dw_error", "error")
    lines = [json.dumps(rows[0]), "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows[1:]:
        lines.append("| " + " | ".join(str(row.get(c, "")).replace("\n", " ")[:200] for c in columns) + " |")
    (out / "norm_kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
