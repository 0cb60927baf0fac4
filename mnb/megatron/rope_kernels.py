"""RoPE in one Triton kernel each way, for the query and key of fused models on GPU ranks.

Why: a fused model's RoPE (:func:`mnb.megatron.fusions.fused_rope`, the slot Megatron leaves for Transformer
Engine's) was Inductor's kernel, which needs a compile before a fresh pool's first fused step and ran above
its memory-bandwidth time in a llama-3b step on an H200 (issue 18's profile).  This kernel reads the query or
key once (strided: Megatron's query and key are views into the fused QKV projection) and writes the rotated
tensor once, each way; a program takes one position and a block of heads, so it reads that position's
``cos``/``sin`` once for all of them.  With it a fused model's RoPE runs fused from its first step, and the
background compile (:mod:`mnb.megatron.background_compile`) leaves it out.

Arithmetic: fp32, rounded once, as the compiled kernel (``fusions._rope`` / ``_rope_grad``); the tables
are the ones :func:`mnb.megatron.fusions.fused_rope` computes once per forward, in the input's dtype.

:func:`mnb.megatron.fusions.fused_rope` calls :func:`rope` where :func:`applies` (CUDA ranks with Triton, or
the interpreter in tests); :data:`enabled` off leaves Inductor's kernel in charge (benchmarks compare both in
one pool).  The kernel is in :mod:`mnb.megatron.rope_triton`, imported on first use.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from mnb.megatron.triton_support import by_pointer, interpreted, next_power_of_two, probe, serves

enabled = True
"""Off: RoPE through the compiled kernel of :mod:`mnb.megatron.fusions` instead.  Set it before ``mnb.gpt``:
a model built while it is on leaves its RoPE out of the background compile (switched off later, the
compiled RoPE compiles at its first use, on the training thread)."""
ELEMENTS = 4096
"""Elements a program rotates: ``ELEMENTS // block width`` heads of one position (its ``cos``/``sin`` read
once for all of them; a program of one head, 128 columns, would be too small to keep the GPU's memory busy).
Tuned by ``bench/train_kernels.py``."""
calls = {"forward": 0, "backward": 0}
"""Kernel launches in this process (tests and diagnostics)."""


def applies(t: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether :func:`rope` takes ``t [s, heads, width]`` with tables ``cos [s, 1, rot]``: on, plain tensors
    of a float dtype, an even ``rot`` no wider than ``t``, one table row per position, on a device where the
    kernel runs at that width."""
    return (enabled and by_pointer(t, cos) and t.dim() == 3 and cos.dim() == 3 and cos.shape[0] == t.shape[0]
            and cos.shape[1] == 1 and cos.shape[-1] % 2 == 0 and 0 < cos.shape[-1] <= t.shape[-1]
            and t.numel() > 0 and cos.device == t.device and runs_on(t.device, t.shape[-1]))


def runs_on(device: torch.device, width: int | None = None) -> bool:
    """Whether this kernel serves tensors on ``device`` and ran there once, forward and backward; with
    ``width`` (a head dimension), at that width.  Triton builds a kernel per block width, so asking when a
    model is built (:func:`serves_models_on`) builds the one its first step runs, outside that step."""
    return serves(device) and _probe(str(device), interpreted(), next_power_of_two(width or PROBE_WIDTH))


def serves_models_on(device: torch.device, head_dim: int | None = None) -> bool:
    """Whether a fused model on ``device`` (heads of ``head_dim``) runs its RoPE here (so it needs no compile)."""
    return enabled and runs_on(device, head_dim)


PROBE_WIDTH = 32
"""The width probed where none is named."""


@functools.lru_cache(maxsize=None)
def _probe(device: str, interpreted: bool, block: int) -> bool:
    """Both directions once on tiny tensors of ``block`` columns, once per device, width and process
    (:func:`triton_support.probe`)."""
    def check(at: torch.device) -> None:
        # 16 heads: sizes that are multiples of 16, as a model's (Triton also builds a kernel per such property
        # of its integer arguments)
        for dtype in (torch.float32, torch.bfloat16):
            t = torch.ones(2, 16, block, device=at, dtype=dtype, requires_grad=True)
            table = torch.ones(2, 1, block, device=at, dtype=dtype)
            rope(t, table, table).sum().backward()

    return probe(f"RoPE kernel ({block} columns)", device, check, "RoPE runs compiled by Inductor")


def _kernel():
    from mnb.megatron import rope_triton

    return rope_triton.rope_kernel


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    positions, heads, width = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = next_power_of_two(width)
    per_program = max(1, ELEMENTS // block)  # a constant per width: one kernel per width, whatever the heads
    _kernel()[(positions, -(-heads // per_program))](x, cos, sin, y, heads, x.stride(0), x.stride(1), cos.shape[-1],
                                                     width, HEADS=per_program, BLOCK=block, BACKWARD=backward,
                                                     num_warps=max(1, min(8, per_program * block // 512)))
    calls["backward" if backward else "forward"] += 1
    return y


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, backward=False)

    @staticmethod
    @once_differentiable  # first order only, as the compiled kernel's
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, backward=True), None, None


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Megatron's non-interleaved RoPE of ``t [s, heads, width]`` with ``cos``/``sin [s, 1, rot]``, with
    autograd, one kernel each way (where :func:`applies`; the caller checks); a new contiguous tensor."""
    return _RoPE.apply(t, cos, sin)
