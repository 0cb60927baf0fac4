"""Measure this GPU's GEMM efficiency curve (and copy bandwidth) for mnb.estimate's calibration table.

    python bench/gemm_sweep.py --out $OUT                 # ~2 minutes on one GPU
    python bench/gemm_sweep.py --out $OUT --budget 30     # shorter

Times bf16 ``torch.matmul`` over squares (256 ... 16384) and the shapes
Megatron's layers produce under tensor parallelism (m = micro batch x sequence,
n or k divided by tp: Llama-1B/3B/8B/70B QKV, projection, fc1, fc2 at tp 1-8),
each the best of repeats within its share of ``--budget`` seconds
(``mnb.megatron.calibrate.measure``).  Writes ``gemm_sweep.json`` (the raw
rates) to ``--out`` and prints the curve as the ``gemm_curve`` literal of
``mnb/estimate/calibration.py`` (fraction of the datasheet peak against the
effective size ``3/(1/m+1/n+1/k)``, the median rate per size bin) and the
``hardware.register(...)`` call that applies it in a session.  Not run in CI.

``--decode``: instead, the decode step's GEMMs (one or a few rows against each llama-1b/3b weight: how
``mnb.generate`` multiplies at batch 1 and 32) through ``torch.matmul`` (Megatron's linears), ``F.linear``
and, for one row, ``torch.mv`` and a plain Triton GEMV (:func:`triton_gemv`, checked against an fp32 mv); each timed as 48 calls captured in one CUDA graph (no launch gaps), the
median of 5 replays, against the copy bandwidth.  The calls cycle through copies of the weight that
together exceed the L2 cache (a weight read again at once would come from L2, not HBM).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from mnb.estimate import hardware
from mnb.megatron.calibrate import GPU_SHAPES, measure

LLAMA = {"llama-1b": (2048, 2048, 512, 8192), "llama-3b": (3072, 3072, 1024, 8192),
         "llama-8b": (4096, 4096, 1024, 14336), "llama-70b": (8192, 8192, 1024, 28672)}
"""hidden, q, kv (query groups x head dim), ffn."""


def megatron_shapes(tokens: int = 16384) -> list[tuple[int, int, int]]:
    shapes = []
    for h, q, kv, ffn in LLAMA.values():
        for tp in (1, 2, 4, 8):
            shapes += [(tokens, (q + 2 * kv) // tp, h), (tokens, h, q // tp),
                       (tokens, 2 * ffn // tp, h), (tokens, h, ffn // tp)]
    return sorted(set(shapes))


MIN_FLOPS = 4e9
"""GEMMs smaller than this are launch-latency bound when timed alone (in training the queue hides it)."""


def curve(rates: list[list[float]], peak: float, bins_per_octave: int = 2) -> list[tuple[int, float]]:
    """Median fraction of ``peak`` per bin of effective size (log-spaced), GEMMs of MIN_FLOPS or more."""
    binned: dict[int, list[tuple[float, float]]] = {}
    for m, n, k, rate in rates:
        if 2 * m * n * k < MIN_FLOPS:
            continue
        d = 3.0 / (1.0 / m + 1.0 / n + 1.0 / k)
        binned.setdefault(round(math.log2(d) * bins_per_octave), []).append((d, rate / peak))
    out = []
    for key in sorted(binned):
        ds, fs = zip(*binned[key])
        out.append((int(round(statistics.median(ds))), round(statistics.median(fs), 3)))
    return out


L2_SPAN = 256 * 2**20
"""Bytes of weight copies the decode GEMMs cycle through: well above an H100/H200's 50-60 MB of L2."""


def graphed_us(fn, calls: int = 50, replays: int = 5) -> float:
    """Microseconds per ``fn()`` call, ``calls`` of them captured in one CUDA graph (median of replays)."""
    from mnb.megatron.decode_graphs import Graph  # warm-up on a side stream, then the capture

    graph = Graph(lambda: [fn() for _ in range(calls)])
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


GEMV_CONFIGS = ((4, 1024, 4), (8, 512, 4), (16, 256, 4), (8, 1024, 8))
"""(rows per program, K per iteration, warps) tried for the Triton GEMV candidate."""


def triton_gemv():
    """``y = W x`` for one row ``x`` as a plain Triton kernel: each program reads a few whole rows of ``W``
    (no split-K), fp32 sums, a bf16 result: a candidate for the small decode GEMMs cuBLAS runs at ~6 us."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(w_ptr, x_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K),
                        other=0.0)
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :].to(tl.float32), axis=1)
        tl.store(y_ptr + rows, acc.to(tl.bfloat16), mask=rows < N)

    def gemv(w: torch.Tensor, x: torch.Tensor, config) -> torch.Tensor:
        block_n, block_k, warps = config
        n, k = w.shape
        y = torch.empty(n, device=w.device, dtype=torch.bfloat16)
        kernel[(triton.cdiv(n, block_n),)](w, x, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
        return y

    return gemv


def decode_gemms(out: Path) -> None:
    """The decode step's GEMMs at 1 and 32 rows by three torch calls (see the module docstring)."""
    import torch.nn.functional as F

    src = torch.empty(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 2 / (graphed_us(lambda: dst.copy_(src), calls=10) / 1e6)  # read + write
    del src, dst
    gemv = triton_gemv()
    rows = []
    for model in ("llama-1b", "llama-3b"):
        h, q, kv, ffn = LLAMA[model]
        for name, (n, k) in {"qkv": (q + 2 * kv, h), "proj": (h, q), "fc1": (2 * ffn, h), "fc2": (h, ffn),
                             "output": (128256, h)}.items():
            copies = max(2, -(-L2_SPAN // (n * k * 2)))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            floor_us = n * k * 2 / bandwidth * 1e6
            for m in (1, 32):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                turn = iter(range(10**9))

                def weight():
                    return weights[next(turn) % copies]

                calls = {"matmul": lambda: torch.matmul(x, weight().t()), "linear": lambda: F.linear(x, weight())}
                if m == 1:
                    calls["mv"] = lambda: torch.mv(weight(), x[0])
                    for config in GEMV_CONFIGS:
                        reference = torch.mv(weights[0].float(), x[0].float())
                        error = float((gemv(weights[0], x[0], config).float() - reference).abs().max()
                                      / reference.abs().max())
                        if error > 1e-2:
                            raise AssertionError(f"triton gemv {config} wrong on {name}: relative error {error}")
                        calls[f"triton {config}"] = lambda config=config: gemv(weight(), x[0], config)
                for how, fn in calls.items():
                    us = graphed_us(fn, calls=48)
                    rows.append(dict(model=model, gemm=name, n=n, k=k, m=m, call=how, us=round(us, 2),
                                     floor_us=round(floor_us, 2), of_bandwidth=round(floor_us / us, 3)))
                    print(rows[-1], flush=True)
            del weights
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_gemms.json").write_text(json.dumps({"copy_bytes_per_s": bandwidth, "rows": rows}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds for the whole sweep")
    parser.add_argument("--decode", action="store_true", help="the decode step's GEMMs instead (see above)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_sweep needs a GPU (CPU ranks measure themselves: %mnb plan --calibrate)")
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    if args.decode:
        decode_gemms(args.out)
        return
    shapes = sorted(set(GPU_SHAPES) | set(megatron_shapes()))
    result = measure(budget_s=args.budget, shapes=shapes)
    dev = hardware.device_from_name(result["device_name"])
    peak = dev.bf16_flops if dev else max(r for *_, r in result["gemm"])
    points = curve(result["gemm"], peak)
    result["peak_flops"], result["curve"] = peak, points
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_sweep.json").write_text(json.dumps(result, indent=1))
    best = max(r for *_, r in result["gemm"])
    print(f"{result['device_name']}: best {best / 1e12:.0f} TFLOP/s ({best / peak:.1%} of {peak / 1e12:.0f}), "
          f"copy {result['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    print(f'"gemm_curve": ({tuple(points)!r}, "bench/gemm_sweep.py on {result["device_name"]}"),')
    print(f"mnb.estimate.hardware.register({(dev.name if dev else 'my-gpu')!r}, gemm_curve={tuple(points)!r}, "
          f"hbm_bytes_per_s={result['copy_bytes_per_s']:.4g}, source='bench/gemm_sweep.py')")


if __name__ == "__main__":
    main()
