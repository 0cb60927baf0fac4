"""The Triton kernel of :mod:`mnb.megatron.fp8_delayed` (which says why, and calls it).

Imported only where Triton is (torch's CUDA wheels bring it).  Under ``TRITON_INTERPRET=1``, set before
Triton is first imported, it runs on CPU tensors: how the tests run it.
"""

import triton
import triton.language as tl

# The token count, the input's row stride and the history's positions change from call to call: left
# unspecialised, so that the probe's few tokens build the kernel every micro batch runs.


@triton.jit(do_not_specialize=["tokens", "x_row", "last", "current", "slot"])
def delayed_cast_kernel(x_ptr, data_ptr, data_t_ptr, state_ptr, scale_ptr, tokens, width, x_row,
                        last, current, slot, slots, fmax,
                        PROGRAMS: tl.constexpr, SLOTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                        ROWS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``PROGRAMS`` programs, each casting tiles of ``BLOCK_T`` tokens x ``BLOCK_K`` columns of
    ``x [tokens, width]``: ``data = saturate(x * scale)`` row by row (``ROWS``) and laid out column by column
    as ``data_t [width, tokens]`` (``TRANSPOSED``), with ``scale = fmax / amax`` from the history in
    ``state`` (fp32: two blocks of ``PROGRAMS`` per-program maxima, the last call's at block ``last`` and
    this call's at block ``current``, then ``slots`` maxima of earlier calls, ``slot`` the oldest).

    Every program reads the same history (all but slot ``slot``), so every program computes the same scale;
    program 0 writes it (for the GEMM) and the last call's amax over slot ``slot``, which no program of this
    call reads.
    Each program writes the max |x| of its own tiles into block ``current`` (every program writes its entry,
    so nothing needs clearing): the next call's history.  The one read of ``x`` gives both."""
    pid = tl.program_id(0)
    programs = tl.arange(0, PROGRAMS)
    newest = tl.max(tl.load(state_ptr + last * PROGRAMS + programs), axis=0)
    s = tl.arange(0, SLOTS)
    older = tl.max(tl.load(state_ptr + 2 * PROGRAMS + s, mask=(s < slots) & (s != slot), other=0.0), axis=0)
    amax = tl.maximum(newest, older)
    scale = tl.math.div_rn(fmax, tl.maximum(amax, 1e-12))
    if pid == 0:
        tl.store(scale_ptr, scale)
        tl.store(state_ptr + 2 * PROGRAMS + slot, newest)
    tiles_k = tl.cdiv(width, BLOCK_K)
    tiles = tl.cdiv(tokens, BLOCK_T) * tiles_k
    seen = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for tile in range(pid, tiles, PROGRAMS):
        row = (tile // tiles_k).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # int64: tokens x width > 2**31
        col = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
        inside = (row < tokens)[:, None] & (col < width)[None, :]
        x = tl.load(x_ptr + row[:, None] * x_row + col[None, :], mask=inside, other=0.0).to(tl.float32)
        seen = tl.maximum(seen, tl.abs(x))
        y = tl.clamp(x * scale, -fmax, fmax)
        if ROWS:
            tl.store(data_ptr + row[:, None] * width + col[None, :], y.to(data_ptr.dtype.element_ty), mask=inside)
        if TRANSPOSED:
            tl.store(data_t_ptr + col[:, None].to(tl.int64) * tokens + row[None, :],
                     tl.trans(y).to(data_t_ptr.dtype.element_ty), mask=tl.trans(inside))
    tl.store(state_ptr + current * PROGRAMS + pid, tl.max(tl.max(seen, axis=1), axis=0))
