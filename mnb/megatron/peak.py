"""This CPU rank's own GEMM peak, measured once per process, for an MFU that means something.

A CPU has no datasheet peak that holds for a rank: it depends on the cores
the rank gets, its threads, the BLAS and the load beside it.  So the first
``mnb.train`` on a CPU rank times a square matmul in the training dtype and
keeps the best rate; the run record carries it (``peak_flops``,
``peak_source``), so ``run.mfu`` reads "vs measured CPU peak 42 GFLOP/s".
Every rank measures at the same moment, as they train, so cores shared
between ranks are shared in the measurement too.  GPU ranks keep the
hardware table (datasheet and measured GEMM peaks in BENCHMARKS.md).
"""

from __future__ import annotations

import time

import torch

GEMM_SIZE = 1024
REPEATS = 5
PROBE_BUDGET_S = 2.0
"""Stop repeating a dtype's matmul once this much time went into it."""

_measured: dict[torch.dtype, float] = {}


def _gemm_rate(dtype: torch.dtype, size: int) -> float:
    """Best FLOP/s of a ``size``-square matmul in ``dtype`` within :data:`PROBE_BUDGET_S`."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.matmul(a, b)  # warm-up: thread pool, BLAS dispatch
    best, spent = float("inf"), 0.0
    for _ in range(REPEATS):
        start = time.perf_counter()
        torch.matmul(a, b)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent > PROBE_BUDGET_S:
            break
    return 2 * size**3 / best


def cpu_gemm_flops(dtype: torch.dtype = torch.float32) -> float:
    """This rank's GEMM peak for training in ``dtype``: the better of fp32 and ``dtype`` (cached).

    A reduced-precision square matmul can run far below what the rank really does: on this
    project's 2-core CI machine a 1024-square bf16 matmul took seconds (0.3 GFLOP/s) while the
    model's own bf16 matmuls ran faster, so an MFU against it read 138 %.  The fp32 rate is a
    floor the rank always reaches; the reduced-precision one is measured at a quarter of the
    size, within a time budget.
    """
    if dtype not in _measured:
        rate = _gemm_rate(torch.float32, GEMM_SIZE)
        if dtype != torch.float32:
            rate = max(rate, _gemm_rate(dtype, GEMM_SIZE // 4))
        _measured[dtype] = rate
    return _measured[dtype]
