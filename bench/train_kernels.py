"""RMSNorm, SwiGLU, RoPE and the loss of a training step on one GPU: torch's eager ops, Inductor's compiled
kernels and mnb's Triton kernels (``mnb.megatron.norm_kernels``, ``swiglu_kernels``, ``rope_kernels``,
``loss_kernels``), forward alone and forward + backward, against the copy bandwidth.

    python bench/train_kernels.py --out OUTDIR        # OUTDIR/train_kernels.json and .md; about two minutes

Shapes, bf16, seq 2048: the norms' inputs of llama-1b (hidden 2048) at micro batch 8 and 16, of llama-3b
(hidden 3072) and llama-8b (hidden 4096) at micro batch 8 and 4; SwiGLU's inputs (``[tokens, 2 x ffn]``)
of llama-1b/3b (ffn 8192) at micro batch 8 and llama-8b (ffn 14336) at micro batch 4; RoPE's query of
llama-1b (32 heads of 64) and llama-3b (24 heads of 128) at micro batch 8; the loss's logits (vocabulary
128,256) at micro batch 8 and 4.  Each side is timed alone on the GPU (CUDA events, median of 20 calls after
5), with the same output gradient each call; the bytes a pass must move at least (RMSNorm forward: read x,
write y; backward: read x and the output gradient, write the input gradient; SwiGLU forward: read 2f, write
f; backward: read f and 2f, write 2f, per token; RoPE: read and write the tensor each way; the loss: read
the logits forward, read them and write their gradient backward) over the time is its bandwidth, beside
``x.clone()``'s.  Every side's output and gradients are checked against fp32 (largest error relative to the
largest value).  ``PROGRAMS_PER_SM``, ``FORWARD_TILE`` and ``BACKWARD_TILE`` of the norm's kernels and ``ELEMENTS`` of RoPE's programs
are swept for mnb's side.  ``gpu_*_ms``: the GPU's own time in kernels per call, from torch's profiler (the
event timings of small calls in a row include the gaps where the CPU launches slower than the GPU runs).  ``--device cpu`` (with ``TRITON_INTERPRET=1``, tiny shapes, wall-clock timing) is a dry
run of the script itself.
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

from mnb.megatron import fusions, loss_kernels, norm_kernels, rope_kernels, swiglu_kernels  # noqa: E402

SHAPES = {"llama-1b mbs 8": (16384, 2048), "llama-1b mbs 16": (32768, 2048), "llama-3b mbs 8": (16384, 3072),
          "llama-8b mbs 4": (8192, 4096)}
SWIGLU_SHAPES = {"llama-1b/3b mbs 8": (16384, 8192), "llama-8b mbs 4": (8192, 14336)}
"""(tokens, ffn): SwiGLU's input is [tokens, 2 x ffn]."""
ROPE_SHAPES = {"llama-1b mbs 8": (2048, 8, 32, 64), "llama-3b mbs 8": (2048, 8, 24, 128)}
"""(seq, micro batch, query heads, head dimension)."""
LOSS_SHAPES = {"vocabulary 128,256 mbs 8": (16384, 128256), "vocabulary 128,256 mbs 4": (8192, 128256)}
"""(tokens, vocabulary)."""
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


def gpu_ms(fn, repeats: int = 10) -> float | None:
    """Milliseconds the GPU spends in kernels and copies per ``fn()``, from torch's profiler: the GPU's own
    time, without the gaps between launches that an event timing of small calls in a row includes where
    the CPU launches slower than the GPU runs (in a training step the CPU runs ahead of the GEMMs).
    None on a CPU dry run."""
    if DEVICE != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    micros = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
    return round(micros / repeats / 1e3, 4)


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
            with torch.no_grad():
                row.update(gpu_forward_ms=gpu_ms(lambda: norm(x, w)))
            row.update(forward_ms=round(forward_ms, 4), forward_GBps=round(2 * size / forward_ms / 1e6, 1),
                       forward_backward_ms=round(both_ms, 4),
                       forward_backward_GBps=round(5 * size / both_ms / 1e6, 1), gpu_forward_backward_ms=gpu_ms(
                           both(norm)), **errors(norm, x, w, dy))
        except Exception:  # noqa: BLE001 - a side that fails is a row that says so
            row["error"] = traceback.format_exc()[-1200:]
        out.append(row)
    kept = norm_kernels.PROGRAMS_PER_SM, norm_kernels.FORWARD_TILE, norm_kernels.BACKWARD_TILE
    mine = sides()["mnb's Triton kernels"]
    settings = ([(n, kept[1], kept[2]) for n in (1, 2, 8)] + [(kept[0], t, kept[2]) for t in (1, 4096, 16384)]
                + [(kept[0], kept[1], t) for t in (4096, 8192, 16384)])  # tiles of 1 element: a row at a time
    for per_sm, forward_tile, backward_tile in settings:
        norm_kernels.PROGRAMS_PER_SM, norm_kernels.FORWARD_TILE, norm_kernels.BACKWARD_TILE = (
            per_sm, forward_tile, backward_tile)
        norm_kernels._programs_on.cache_clear()
        side = (f"mnb, {per_sm} backward programs per SM, tiles of {forward_tile} elements forward, "
                f"{backward_tile} backward")
        try:
            ms = timed(both(mine))
            with torch.no_grad():
                forward = gpu_ms(lambda: mine(x, w))
            out.append({"shape": f"RMSNorm {label}", "side": side, "gpu_forward_ms": forward,
                        "forward_backward_ms": round(ms, 4), "forward_backward_GBps": round(5 * size / ms / 1e6, 1),
                        "gpu_forward_backward_ms": gpu_ms(both(mine))})
        except Exception:  # noqa: BLE001
            out.append({"shape": f"RMSNorm {label}", "side": side, "error": traceback.format_exc()[-1200:]})
    norm_kernels.PROGRAMS_PER_SM, norm_kernels.FORWARD_TILE, norm_kernels.BACKWARD_TILE = kept
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
    return compare(f"SwiGLU {label}", swiglu_sides(), lambda: y.clone(), g, fusions._swiglu(y.float()),
                   fusions._swiglu_grad(g.float(), y.float()), 3 * half, 8 * half)


def relative(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def compare(label: str, sides: dict, make, grad, exact, exact_grad, fwd_bytes: int, both_bytes: int) -> list[dict]:
    """Rows of each side ``fn(x)`` of one shape: forward alone and forward + backward (output gradient
    ``grad``), timed, and its errors against the fp32 ``exact`` output and input gradient."""
    out = []
    x = make()
    xg = make().requires_grad_()

    def both(fn):
        def step():
            xg.grad = None
            fn(xg).backward(grad)
        return step

    for name, fn in sides.items():
        row = {"shape": label, "side": name}
        try:
            with torch.no_grad():
                forward_ms = timed(lambda: fn(x))
            both_ms = timed(both(fn))
            with torch.no_grad():
                row.update(gpu_forward_ms=gpu_ms(lambda: fn(x)))
            row.update(gpu_forward_backward_ms=gpu_ms(both(fn)))
            xg.grad = None
            got = fn(xg)
            got.backward(grad)
            row.update(forward_ms=round(forward_ms, 4), forward_GBps=round(fwd_bytes / forward_ms / 1e6, 1),
                       forward_backward_ms=round(both_ms, 4),
                       forward_backward_GBps=round(both_bytes / both_ms / 1e6, 1),
                       y_error=relative(got.detach(), exact), dx_error=relative(xg.grad, exact_grad))
        except Exception:  # noqa: BLE001 - a side that fails is a row that says so
            row["error"] = traceback.format_exc()[-1200:]
        out.append(row)
    return out


def measure_rope(label: str, seq: int, batch: int, heads: int, head: int) -> list[dict]:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    gen = torch.Generator(device=DEVICE).manual_seed(seq + heads)
    t = torch.randn(seq, batch, heads, head, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    freqs = torch.randn(seq, 1, 1, head, device=DEVICE, generator=gen)
    g = torch.randn(t.shape, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    exact_t = t.float().requires_grad_()
    exact = _apply_rotary_pos_emb_bshd(exact_t, freqs)
    exact.backward(g.float())
    size = t.numel() * t.element_size()
    sides = {"torch eager (Megatron's unfused RoPE)": lambda x: _apply_rotary_pos_emb_bshd(x, freqs),
             "Inductor (mnb.megatron.fusions)": lambda x: fusions.fused_rope(x, freqs, compiled=True),
             "mnb's Triton kernel": lambda x: fusions.fused_rope(x, freqs)}
    rows = compare(f"RoPE {label}", sides, lambda: t.clone(), g, exact.detach(), exact_t.grad, 2 * size, 4 * size)
    kept = rope_kernels.ELEMENTS
    tg = t.clone().requires_grad_()

    def both():
        tg.grad = None
        fusions.fused_rope(tg, freqs).backward(g)

    for elements in (512, 1024, 2048, 4096, 8192):  # elements a program rotates
        rope_kernels.ELEMENTS = elements
        try:
            ms = timed(both)
            rows.append({"shape": f"RoPE {label}", "side": f"mnb, {elements} elements a program",
                         "forward_backward_ms": round(ms, 4), "forward_backward_GBps": round(4 * size / ms / 1e6, 1)})
        except Exception:  # noqa: BLE001
            rows.append({"shape": f"RoPE {label}", "side": f"mnb, {elements} elements a program",
                         "error": traceback.format_exc()[-1200:]})
    rope_kernels.ELEMENTS = kept
    return rows


def measure_loss(label: str, tokens: int, vocab: int) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    logits = (4 * torch.randn(tokens, vocab, device=DEVICE, generator=gen)).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=gen)
    g = torch.rand(tokens, device=DEVICE, generator=gen)
    exact_logits = logits.float().requires_grad_()
    exact = F.cross_entropy(exact_logits, target, reduction="none")
    exact.backward(g)
    exact_grad, exact = exact_logits.grad, exact.detach()
    del exact_logits
    size = logits.numel() * logits.element_size()
    sides = {"eager by rows (fusions, while compiling)":
             lambda x: fusions.vocab_parallel_cross_entropy(x, target, None, compiled=False),
             "Inductor (mnb.megatron.fusions)": lambda x: fusions.vocab_parallel_cross_entropy(x, target, None,
                                                                                              compiled=True),
             "mnb's Triton kernels": lambda x: fusions.vocab_parallel_cross_entropy(x, target, None)}
    return compare(f"loss {label}", sides, lambda: logits.clone(), g, exact, exact_grad, size, 3 * size)


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
    rope_shapes = ROPE_SHAPES if DEVICE == "cuda" else {"dry run": (16, 2, 3, 32)}
    loss_shapes = LOSS_SHAPES if DEVICE == "cuda" else {"dry run": (24, 5000)}
    rows = [{"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
             **{f"{kernels.__name__.rsplit('.', 1)[1]}_run": kernels.runs_on(torch.device(DEVICE))
                for kernels in (norm_kernels, swiglu_kernels, rope_kernels, loss_kernels)}}]
    for label, (tokens, width) in shapes.items():
        rows += measure(label, tokens, width)
        (out / "train_kernels.json").write_text(json.dumps(rows, indent=1))
    for label, (tokens, ffn) in swiglu_shapes.items():
        rows += measure_swiglu(label, tokens, ffn)
        (out / "train_kernels.json").write_text(json.dumps(rows, indent=1))
    for label, shape in rope_shapes.items():
        rows += measure_rope(label, *shape)
        (out / "train_kernels.json").write_text(json.dumps(rows, indent=1))
    for label, shape in loss_shapes.items():
        rows += measure_loss(label, *shape)
        (out / "train_kernels.json").write_text(json.dumps(rows, indent=1))
    rows[0]["kernel_calls"] = {kernels.__name__.rsplit('.', 1)[1]: dict(kernels.calls)
                               for kernels in (norm_kernels, swiglu_kernels, rope_kernels, loss_kernels)}
    columns = ("shape", "side", "forward_ms", "forward_GBps", "forward_backward_ms", "forward_backward_GBps",
               "gpu_forward_ms", "gpu_forward_backward_ms", "y_error", "dx_error", "dw_error", "error")
    lines = [json.dumps(rows[0]), "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows[1:]:
        lines.append("| " + " | ".join(str(row.get(c, "")).replace("\n", " ")[:200] for c in columns) + " |")
    (out / "train_kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
