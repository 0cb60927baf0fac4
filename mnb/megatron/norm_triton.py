"""The Triton kernels of :mod:`mnb.megatron.norm_kernels` (which says why, and calls them).

Imported only where Triton is (torch's CUDA wheels bring it).  Under ``TRITON_INTERPRET=1``, set before
Triton is first imported, they run on CPU tensors: how the tests run them.
"""

import triton
import triton.language as tl

# Triton builds a kernel per value of an integer argument that is 1 or a multiple of 16: the row counts are
# left unspecialised, so that the kernel a model's first step runs (16,384 rows, 32 a backward program) is the
# one mnb's probe built on a few rows (and a decode step's single row runs it too).


@triton.jit(do_not_specialize=["rows"])
def rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, rows, x_row, y_row, width, eps,
                            BLOCK: tl.constexpr, ROWS: tl.constexpr, SAVE_RSTD: tl.constexpr):
    """One program per ``ROWS`` rows: ``y = x * rstd * w`` with ``rstd = 1 / sqrt(mean(x²) + eps)``, all in
    fp32 and rounded once (as ``F.rms_norm``); ``rstd`` kept for the backward when ``SAVE_RSTD``.  Several
    rows a program keep more bytes in flight where a row is narrow."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64: tokens x hidden can pass 2**31
    cols = tl.arange(0, BLOCK)
    row_inside = row < rows
    inside = row_inside[:, None] & (cols < width)[None, :]
    x = tl.load(x_ptr + row[:, None] * x_row + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)
    w = tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + row[:, None] * y_row + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=inside)
    if SAVE_RSTD:
        tl.store(rstd_ptr + row, rstd, mask=row_inside)


@triton.jit(do_not_specialize=["rows", "per_program"])
def rms_norm_backward_kernel(g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, per_program,
                             g_row, x_row, dx_row, width, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                             WEIGHT_GRAD: tl.constexpr):
    """One program per block of ``per_program`` consecutive rows (a multiple of ``ROWS``), in one pass over
    them, ``ROWS`` at a time: each row's input gradient ``dx = rstd * (w*g - x̂ * mean(x̂ * w*g))``
    (x̂ = x * rstd), and the weight gradient of the block, ``Σ g * x̂`` over its rows in fp32, into row
    ``program`` of ``dw`` (the caller sums the blocks; nothing of it without ``WEIGHT_GRAD``, for a frozen
    weight).

    Reading ``x`` and ``g`` once for both gradients is the point: a norm's backward is a pass over
    memory, and computing ``dw`` in a second kernel (a column reduction) reads both again."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_inside = cols < width
    w = tl.load(w_ptr + cols, mask=col_inside, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    first = program.to(tl.int64) * per_program
    last = tl.minimum(first + per_program, rows)
    for start in range(first, last, ROWS):
        row = start + tl.arange(0, ROWS)
        row_inside = row < last
        inside = row_inside[:, None] & col_inside[None, :]
        x = tl.load(x_ptr + row[:, None] * x_row + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row[:, None] * g_row + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row_inside, other=0.0)
        x_hat = x * rstd[:, None]
        wg = w[None, :] * g
        mean = tl.sum(x_hat * wg, axis=1) / width
        dx = (wg - x_hat * mean[:, None]) * rstd[:, None]
        tl.store(dx_ptr + row[:, None] * dx_row + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=inside)
        if WEIGHT_GRAD:
            dw += g * x_hat  # rows outside are 0 (masked loads)
    if WEIGHT_GRAD:
        tl.store(dw_ptr + program.to(tl.int64) * width + cols, tl.sum(dw, axis=0), mask=col_inside)
