"""Throughput of mnb's context-parallel attention against plain SDPA, one GPU, cp = 1.

    python bench/gpu_cp_attention.py                          # device machine: seq 8k, 16k, 32k, bf16
    python bench/gpu_cp_attention.py --seq 8192 --json out.json
    python bench/gpu_cp_attention.py --device cpu --seq 512   # smoke test, any machine

With cp = 1 the K/V all-gather is the identity, so this measures only what the
chunked form costs on its own (mnb.megatron.context_parallel.attention): the
sequence in Megatron's two cp chunks, the second one attending its prefix
through a lower-right causal bias, against one ``F.scaled_dot_product_attention``
call with ``is_causal=True``.  Forward and forward + backward, CUDA events,
median of ``--iters`` after ``--warmup``.  TFLOP/s count causal attention only
(forward 2·2·b·heads·s²·d / 2, backward 2.5x forward).  The shape defaults are
Llama-3-8B's attention on one tp rank (32 heads, 8 query groups, head dim 128).
Results go in BENCHMARKS.md; multi-GPU cp is measured by the 2-GPU issue.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's mnb, installed or not

from mnb.megatron.context_parallel import attention  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sdpa(q, k, v):
    """Plain SDPA on Megatron's [s, b, n, d] layout (what SDPAttention runs at cp = 1)."""
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                         enable_gqa=k.shape[2] != q.shape[2])
    return out.permute(2, 0, 1, 3)


def chunked(q, k, v):
    return attention(q, k, v, group=None, causal=True)


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
    else:
        def run(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return run


def measure(fn, inputs, grad, *, backward: bool, warmup: int, iters: int, timer) -> float:
    """Median seconds of one call (with its backward when asked)."""
    def once():
        out = fn(*inputs)
        if backward:
            out.backward(grad)
    for _ in range(warmup):
        once()
    times = [timer(once) for _ in range(iters)]
    return statistics.median(times)


def bench(seq: int, args, device: torch.device) -> dict:
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(seq)
    shape = (seq, args.batch)
    q = torch.randn(*shape, args.heads, args.head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(*shape, args.groups, args.head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(*shape, args.groups, args.head_dim, device=device, dtype=dtype, generator=gen)
    grad = torch.randn_like(q)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    with torch.no_grad():
        diff = float((sdpa(q, k, v).float() - chunked(q, k, v).float()).abs().max())
    timer = _timer(device)
    fwd_flops = 2 * 2 * args.batch * args.heads * seq * seq * args.head_dim / 2
    row = {"seq": seq, "max_abs_diff": diff}
    for name, fn in (("sdpa", sdpa), ("mnb_cp", chunked)):
        with torch.no_grad():
            row[f"{name}_fwd_s"] = measure(fn, [t.detach() for t in inputs], grad, backward=False,
                                           warmup=args.warmup, iters=args.iters, timer=timer)
        row[f"{name}_fwdbwd_s"] = measure(fn, inputs, grad, backward=True, warmup=args.warmup,
                                          iters=args.iters, timer=timer)
        row[f"{name}_fwdbwd_tflops"] = 3.5 * fwd_flops / row[f"{name}_fwdbwd_s"] / 1e12
    row["fwd_ratio"] = row["mnb_cp_fwd_s"] / row["sdpa_fwd_s"]
    row["fwdbwd_ratio"] = row["mnb_cp_fwdbwd_s"] / row["sdpa_fwdbwd_s"]
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'seq':>6} {'sdpa fwd ms':>12} {'mnb fwd ms':>11} {'ratio':>6} {'sdpa f+b ms':>12} "
            f"{'mnb f+b ms':>11} {'ratio':>6} {'sdpa TF/s':>10} {'mnb TF/s':>9} {'max|diff|':>10}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['seq']:>6} {r['sdpa_fwd_s'] * 1e3:12.2f} {r['mnb_cp_fwd_s'] * 1e3:11.2f} {r['fwd_ratio']:6.2f} "
            f"{r['sdpa_fwdbwd_s'] * 1e3:12.2f} {r['mnb_cp_fwdbwd_s'] * 1e3:11.2f} {r['fwdbwd_ratio']:6.2f} "
            f"{r['sdpa_fwdbwd_tflops']:10.2f} {r['mnb_cp_fwdbwd_tflops']:9.2f} {r['max_abs_diff']:10.2e}"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test)")
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--groups", type=int, default=8, help="query groups (K/V heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here; use --device cpu --seq 512 for a smoke test")
    for seq in args.seq:
        if seq % 2:
            p.error(f"--seq {seq}: the two cp chunks need an even sequence length")
    if device.type == "cpu" and args.seq == p.get_default("seq"):
        p.error("the default lengths (8k-32k) are for a GPU; on CPU pass e.g. --seq 512")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {args.dtype}, batch {args.batch}, heads {args.heads}, "
          f"query groups {args.groups}, head dim {args.head_dim}, cp=1")
    rows = [bench(seq, args, device) for seq in args.seq]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "args": vars(args), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
