"""The Triton kernels of :mod:`mnb.megatron.norm_kernels` (which says why, and calls them).

Imported only where Triton is (torch's CUDA wheels bring it).  Under ``TRITON_INTERPRET=1``, set before
Triton is first imported, they run on CPU tensors: how the tests run them.
"""

import triton
import triton.language as tl


@triton.jit
def rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, x_row, y_row, width, eps,
                            BLOCK: tl.constexpr, SAVE_RSTD: tl.constexpr):
    """One program per row: ``y = x * rstd * w`` with ``rstd = 1 / sqrt(mean(x²) + eps)``, all in fp32 and
    rounded once (as ``F.rms_norm``); ``rstd`` kept for the backward when ``SAVE_RSTD``."""
    row = tl.program_id(0).to(tl.int64)  # offsets in int64: tokens x hidden can pass 2**31
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(x_ptr + row * x_row + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_row + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=inside)
    if SAVE_RSTD:
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def rms_norm_backward_kernel(g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, per_program,
                             g_row, x_row, dx_row, width, BLOCK: tl.constexpr, WEIGHT_GRAD: tl.constexpr):
    """One program per block of ``per_program`` consecutive rows, in one pass over them: each row's input
    gradient ``dx = rstd * (w*g - x̂ * mean(x̂ * w*g))`` (x̂ = x * rstd), and the weight gradient of the
    block, ``Σ g * x̂`` over its rows in fp32, into row ``program`` of ``dw`` (the caller sums the blocks;
    nothing of it without ``WEIGHT_GRAD``, for a frozen weight).

    Reading ``x`` and ``g`` once for both gradients is the point: a norm's backward is a pass over
    memory, and computing ``dw`` in a second kernel (a column reduction) reads both again."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = program.to(tl.int64) * per_program
    last = tl.minimum(first + per_program, rows)
    for row in range(first, last):
        x = tl.load(x_ptr + row * x_row + cols, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * g_row + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        wg = w * g
        mean = tl.sum(x_hat * wg, axis=0) / width
        tl.store(dx_ptr + row * dx_row + cols, ((wg - x_hat * mean) * rstd).to(dx_ptr.dtype.element_ty),
                 mask=inside)
        if WEIGHT_GRAD:
            dw += g * x_hat
    if WEIGHT_GRAD:
        tl.store(dw_ptr + program.to(tl.int64) * width + cols, dw, mask=inside)
