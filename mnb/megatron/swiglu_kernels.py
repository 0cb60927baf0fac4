"""SwiGLU in one Triton kernel each way, for the dense MLPs of fused models on GPU ranks.

Why: the SwiGLU of a Llama MLP is a pass over the largest activations of the step (``[tokens, 2 x ffn]``
in, ``[tokens, ffn]`` out), and its compiled form (:func:`mnb.megatron.fusions.swiglu`, Inductor's kernel)
ran its backward well above memory-bandwidth time in a llama-3b step on an H200 (0.13 s a step, issue 18's
profile).  These kernels read ``y = [gate | up]`` and write the output once forward, and read the output
gradient and ``y`` once for both halves of the input gradient backward, with wide contiguous blocks.
They also need no compile: a fused model's SwiGLU runs fused from its first step, and the background
compile (:mod:`mnb.megatron.background_compile`) leaves its widths out.

Arithmetic: fp32, rounded once, as the compiled kernel (``fusions._swiglu`` / ``_swiglu_grad``); the
input ``y`` is kept for the backward, as before.

:func:`mnb.megatron.fusions.swiglu` calls :func:`swiglu` where :func:`applies` (CUDA ranks with Triton,
or the interpreter in tests); :data:`enabled` off leaves Inductor's kernel in charge (benchmarks compare
both in one pool).  The kernels are in :mod:`mnb.megatron.swiglu_triton`, imported on first use.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from mnb.megatron.triton_support import as_rows, by_pointer, interpreted, probe, serves

enabled = True
"""Off: SwiGLU through the compiled kernel of :mod:`mnb.megatron.fusions` instead.  Set it before ``mnb.gpt``:
a model built while it is on leaves its SwiGLU out of the background compile (switched off later, the
compiled SwiGLU compiles at its first use, on the training thread)."""
BLOCK = 1024
"""Columns of one half (gate or up) a program takes."""
WARPS = 4
calls = {"forward": 0, "backward": 0}
"""Kernel launches in this process (tests and diagnostics)."""


def applies(x: torch.Tensor) -> bool:
    """Whether :func:`swiglu` takes ``x = [..., 2f]``: on, a plain tensor of a float dtype with an even last
    dimension, on a device where the kernels run."""
    return enabled and by_pointer(x) and x.shape[-1] % 2 == 0 and x.numel() > 0 and runs_on(x.device)


def runs_on(device: torch.device) -> bool:
    """Whether these kernels serve tensors on ``device`` and ran there once, forward and backward."""
    return serves(device) and _probe(str(device), interpreted())


def serves_models_on(device: torch.device) -> bool:
    """Whether a fused model on ``device`` runs its SwiGLU here (so its widths need no compile)."""
    return enabled and runs_on(device)


@functools.lru_cache(maxsize=None)
def _probe(device: str, interpreted: bool) -> bool:
    """Both kernels once on tiny tensors, once per device and process (:func:`triton_support.probe`)."""
    def check(at: torch.device) -> None:
        for dtype in (torch.float32, torch.bfloat16):
            swiglu(torch.ones(3, 32, device=at, dtype=dtype, requires_grad=True)).sum().backward()

    return probe("SwiGLU kernels", device, check, "SwiGLU runs compiled by Inductor")


def _kernels():
    from mnb.megatron import swiglu_triton

    return swiglu_triton.swiglu_forward_kernel, swiglu_triton.swiglu_backward_kernel


def _grid(rows: int, width: int) -> tuple[int, int]:
    return rows, -(-width // BLOCK)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = as_rows(x)
        width = y.shape[-1] // 2
        out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
        _kernels()[0][_grid(y.shape[0], width)](y, out, width, y.stride(0), width, BLOCK=BLOCK, num_warps=WARPS)
        calls["forward"] += 1
        ctx.save_for_backward(y)
        ctx.input_shape = x.shape
        return out

    @staticmethod
    @once_differentiable  # first order only: the gradient carries no graph, as the compiled kernel's
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        width = y.shape[-1] // 2
        g = as_rows(grad)
        dy = torch.empty(ctx.input_shape, dtype=y.dtype, device=y.device)
        _kernels()[1][_grid(y.shape[0], width)](g, y, dy, width, g.stride(0), y.stride(0), 2 * width,
                                                BLOCK=BLOCK, num_warps=WARPS)
        calls["backward"] += 1
        return dy


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [..., 2f]`` (gate first, as Megatron's fc1 lays it out), with autograd,
    one kernel each way (where :func:`applies`; the caller checks)."""
    return _SwiGLU.apply(x)
