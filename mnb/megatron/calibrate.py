"""Measure this machine for the step-time model: GEMM rate by shape, memory bandwidth, all-reduce.

``%mnb plan --calibrate`` runs :func:`measure` on every rank of the live pool
(the all-reduce needs them all) and hands rank 0's numbers to
:func:`mnb.estimate.measured.register_measurement`, which turns them into a
device entry (GEMM curve, bandwidths) with this measurement as the source of
every number it replaced.  ``bench/gemm_sweep.py`` runs the same function with
a longer sweep on a GPU.  The whole measurement stays within ``budget_s``
(default 30 s on a GPU, 3 s on CPU ranks): each shape is repeated until its
share of the budget is spent, and the best rate is kept.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

GPU_SHAPES = [(s, s, s) for s in (256, 512, 1024, 2048, 4096, 8192, 16384)] + [
    (16384, 1024, 4096), (16384, 4096, 1024), (8192, 2048, 8192), (16384, 8192, 2048), (4096, 512, 4096),
]
"""(m, n, k): squares for the curve's spine, Megatron-like skinny shapes (tp-split n or k) around it."""
CPU_SHAPES = [(s, s, s) for s in (64, 128, 256, 512)] + [(512, 128, 512)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, budget_s: float, min_repeats: int = 3) -> float:
    fn()  # warm-up: kernel selection, thread pools
    _sync(device)
    best, spent, n = float("inf"), 0.0, 0
    while n < min_repeats or spent < budget_s:
        start = time.perf_counter()
        fn()
        _sync(device)
        took = time.perf_counter() - start
        best, spent, n = min(best, took), spent + took, n + 1
        if spent > 4 * budget_s:
            break
    return best


def _best_collective_time(fn, device: torch.device, budget_s: float, min_repeats: int = 3) -> float:
    """The best time of a collective ``fn`` as the slowest rank saw it.

    Every rank must call a collective the same number of times: :func:`_best_time` stops on each
    rank's own clock, so on a loaded machine one rank would run one all-reduce more than another,
    which pairs it with a different call (gloo aborts or hangs).  The count is agreed first, from
    the slowest rank's warm-up time."""
    def timed() -> float:
        start = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - start

    def slowest(seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    fn()  # warm-up: connections, buffers
    _sync(device)
    first = slowest(timed())
    repeats = max(min_repeats, min(50, int(budget_s / max(first, 1e-6))))
    return slowest(min(timed() for _ in range(repeats)))


def measure(budget_s: float | None = None, shapes: list[tuple[int, int, int]] | None = None) -> dict[str, Any]:
    """GEMM FLOP/s per shape, copy bandwidth and all-reduce bus bandwidth on this rank (plain data)."""
    on_gpu = _on_gpu()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    budget = budget_s if budget_s is not None else (30.0 if on_gpu else 3.0)
    shapes = shapes or (GPU_SHAPES if on_gpu else CPU_SHAPES)
    per_item = budget / (len(shapes) + 2)
    gemms = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        took = _best_time(lambda: torch.matmul(a, b), device, per_item)
        gemms.append([m, n, k, 2 * m * n * k / took])
        del a, b
    size = (1 << 30) if on_gpu else (64 << 20)  # bytes of the copied buffer
    src = torch.empty(size // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = _best_time(lambda: dst.copy_(src), device, per_item)
    del src, dst
    result: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "gemm": gemms,
        "copy_bytes_per_s": 2 * size / copy_s,
        "world_size": 1,
        "allreduce_bus_bytes_per_s": None,
        "intra_node": True,
    }
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        nbytes = (256 << 20) if on_gpu else (8 << 20)
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        took = _best_collective_time(lambda: dist.all_reduce(buf), device, per_item)
        result.update(
            world_size=world,
            allreduce_bus_bytes_per_s=2 * (world - 1) / world * nbytes / took,
            intra_node=_local_world() == world,
        )
    return result


def _on_gpu() -> bool:
    """CUDA ranks talk NCCL; CPU ranks (gloo) may run where CUDA exists but is not theirs."""
    if dist.is_available() and dist.is_initialized():
        return "nccl" in str(dist.get_backend()).lower()
    return torch.cuda.is_available()


def _local_world() -> int:
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or dist.get_world_size()
