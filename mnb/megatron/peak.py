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

_measured: dict[torch.dtype, float] = {}


def cpu_gemm_flops(dtype: torch.dtype = torch.float32) -> float:
    """Best FLOP/s of a ``GEMM_SIZE``-square matmul on this process's threads (cached per dtype)."""
    if dtype not in _measured:
        a = torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=dtype)
        b = torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=dtype)
        torch.matmul(a, b)  # warm-up: thread pool, BLAS dispatch
        best = float("inf")
        for _ in range(REPEATS):
            start = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - start)
        _measured[dtype] = 2 * GEMM_SIZE**3 / best
    return _measured[dtype]
