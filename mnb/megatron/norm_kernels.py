"""RMSNorm in one Triton kernel each way, for training and for the decode step.

Why: a norm is a pass over memory, and torch's took about three times its bandwidth time in a
llama-3b training step on an H200 (0.19 s of a 4.9 s step for 57 norms a micro batch, where reading
and writing each tensor once takes about 0.06 s; BENCHMARKS.md, issue 18's profile), the largest
item after the GEMMs, flash attention and mnb's compiled loss, RoPE and SwiGLU.  Here:

- forward: one program a tile of rows (:data:`FORWARD_TILE` elements) reads ``x`` once and writes ``y``
  once, keeping ``rstd`` (4 bytes a row) for the backward;
- backward: one program a block of rows reads ``x`` and the output gradient once for both
  gradients: the input gradient row by row, and the block's share of the weight gradient summed in
  fp32 registers (the blocks' shares then summed by torch, a few MB).  Computing the weight gradient
  in a kernel of its own (a column reduction, as torch's and Inductor's norms do) reads both again.

Arithmetic: fp32 throughout, rounded once to the input's dtype (the weight gradient to the weight's),
as torch's ``F.rms_norm`` and its backward; not bit for bit the same (the sums run in another order).
What the backward keeps is what torch's fused norm keeps: the input and ``rstd``.

Used by :class:`mnb.megatron.spec.LocalNorm` on the GPU ranks of models built with fused kernels
(``mnb.gpt(fusions="auto")``, the default) and by the decode step (:mod:`mnb.megatron.decode_kernels`);
:data:`enabled` off, or a width above :data:`MAX_WIDTH`, leaves torch's norm in charge.  The kernels
are in :mod:`mnb.megatron.norm_triton`, imported on first use (it needs Triton).
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from mnb.megatron.triton_support import as_rows, by_pointer, interpreted, next_power_of_two, probe, serves

enabled = True
"""Off: models that would use these kernels use torch's ``F.rms_norm`` instead (benchmarks compare both
in one pool; the decode step's own switch is :data:`mnb.megatron.decode_graphs.own_kernels`)."""
MAX_WIDTH = 16384
"""Widest row a program takes whole (wider rows go to torch's norm)."""
PROGRAMS_PER_SM = 4
"""Backward programs per streaming multiprocessor: each keeps one block's weight-gradient share."""
FORWARD_TILE = 8192
"""Elements a forward program takes: whole rows, several where a row is narrower.  On an H200 (bf16, 16,384
rows; ``bench/train_kernels.py``, 2026-12-05) tiles of 8,192 took llama-3b's 3,072-wide rows in 0.052 ms
against 0.069 ms a row a program, and llama-1b's 2,048-wide rows in the same 0.037 ms."""
BACKWARD_TILE = 1
"""Elements a backward program takes at a time (rounded up to a whole row): one row, which measured fastest
there (llama-1b's rows 0.070 ms against 0.095 ms in tiles of 8,192; llama-3b's 0.117 against 0.145)."""
calls = {"forward": 0, "backward": 0}
"""Kernel launches in this process (tests and diagnostics)."""


def applies(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether :func:`rms_norm` takes ``x`` (and ``weight``) here: on, a weighted norm of a float dtype
    no wider than :data:`MAX_WIDTH`, on a device where the kernels run at that width."""
    return (enabled and weight is not None and by_pointer(x, weight) and weight.shape == x.shape[-1:]
            and weight.is_contiguous() and weight.device == x.device
            and x.shape[-1] <= MAX_WIDTH and x.numel() > 0 and runs_on(x.device, x.shape[-1]))


def runs_on(device: torch.device, width: int | None = None) -> bool:
    """Whether these kernels serve tensors on ``device`` (:func:`mnb.megatron.triton_support.serves`), and
    ran once there on tiny tensors, forward and backward; with ``width`` (a hidden size), at that width.
    Triton builds a kernel per block width, so :func:`mnb.megatron.model.gpt` asks for the model's hidden
    size when it builds it: the kernel its first step runs is built then, outside any forward."""
    block = next_power_of_two(min(width or PROBE_WIDTH, MAX_WIDTH))
    return serves(device) and _probe(str(device), interpreted(), block)


PROBE_WIDTH = 16
"""The width probed where none is named."""


@functools.lru_cache(maxsize=None)
def _probe(device: str, interpreted: bool, block: int) -> bool:
    """Both kernels once on tiny tensors of ``block`` columns, once per device, width and process
    (:func:`triton_support.probe`)."""
    def check(at: torch.device) -> None:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.ones(3, block, device=at, dtype=dtype, requires_grad=True)
            rms_norm(x, torch.ones(block, device=at, dtype=dtype, requires_grad=True), 1e-5).sum().backward()

    return probe(f"RMSNorm kernels ({block} columns)", device, check, "norms run as torch's")


def _kernels():
    from mnb.megatron import norm_triton

    return norm_triton.rms_norm_forward_kernel, norm_triton.rms_norm_backward_kernel


def _rows_at_once(tile: int, block: int) -> int:
    """Rows a program takes at a time (a power of two): as many as fill ``tile`` elements, at least one."""
    return max(1, tile // block)


def _warps(elements: int) -> int:
    return min(16, max(1, elements // 256))


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float, *, keep_rstd: bool = False):
    """``F.rms_norm(x, (width,), weight, eps)`` in one kernel; with ``keep_rstd``, ``(y, x as rows, rstd)``
    for a backward."""
    width = x.shape[-1]
    if width > MAX_WIDTH:
        return torch.nn.functional.rms_norm(x, (width,), weight, eps)
    rows = as_rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # itself, not a view: callers may write into it
    rstd = torch.empty(rows.shape[0] if keep_rstd else 1, dtype=torch.float32, device=x.device)
    block = next_power_of_two(width)
    at_once = _rows_at_once(FORWARD_TILE, block)
    count = rows.shape[0]
    _kernels()[0][(-(-count // at_once),)](rows, weight, y, rstd, count, rows.stride(0), width, width,
                                           float(eps), BLOCK=block, ROWS=at_once, SAVE_RSTD=keep_rstd,
                                           num_warps=_warps(block * at_once))
    calls["forward"] += 1
    return (y, rows, rstd) if keep_rstd else y


@functools.lru_cache(maxsize=None)
def _programs_on(device: str) -> int:
    at = torch.device(device)
    if at.type != "cuda":
        return 4  # the interpreter: a few blocks, so that the weight gradient sums several
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(at).multi_processor_count


def backward(grad: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
             weight_grad: bool = True):
    """``(dx, dw)`` of :func:`forward` for the output gradient ``grad``, from what it kept; ``dw`` None
    without ``weight_grad`` (a frozen weight: no blocks summed)."""
    count, width = rows.shape
    g = as_rows(grad)
    dx = torch.empty(grad.shape, dtype=rows.dtype, device=rows.device)
    block = next_power_of_two(width)
    at_once = _rows_at_once(BACKWARD_TILE, block)
    per_program = -(-count // min(count, _programs_on(str(rows.device))))
    per_program = -(-per_program // at_once) * at_once  # whole tiles: a tile never spans two programs
    programs = -(-count // per_program)
    shares = torch.empty(programs if weight_grad else 1, width, dtype=torch.float32, device=rows.device)
    _kernels()[1][(programs,)](g, rows, weight, rstd, dx, shares, count, per_program,
                               g.stride(0), rows.stride(0), width, width, BLOCK=block, ROWS=at_once,
                               WEIGHT_GRAD=weight_grad, num_warps=_warps(block * at_once))
    calls["backward"] += 1
    return dx, shares.sum(dim=0).to(weight.dtype) if weight_grad else None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rows, rstd = forward(x, weight, eps, keep_rstd=True)
        ctx.save_for_backward(rows, weight, rstd)
        return y

    @staticmethod
    @once_differentiable  # first order only: the gradient carries no graph (torch's norm has a double backward)
    def backward(ctx, grad):
        rows, weight, rstd = ctx.saved_tensors
        dx, dw = backward(grad, rows, weight, rstd, weight_grad=ctx.needs_input_grad[1])
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (x.shape[-1],), weight, eps)`` with autograd, one kernel each way (where
    :func:`applies`; the caller checks)."""
    if x.shape[-1] > MAX_WIDTH:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return forward(x, weight, eps)
