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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds for the whole sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_sweep needs a GPU (CPU ranks measure themselves: %mnb plan --calibrate)")
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
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
