"""The Triton kernel of :mod:`mnb.megatron.rope_kernels` (which says why, and calls it).

Imported only where Triton is (torch's CUDA wheels bring it).  Under ``TRITON_INTERPRET=1``, set before
Triton is first imported, it runs on CPU tensors: how the tests run it.
"""

import triton
import triton.language as tl


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, heads, x_pos, x_head, rot, width,
                HEADS: tl.constexpr, BLOCK: tl.constexpr, BACKWARD: tl.constexpr):
    """One program per (position, block of ``HEADS`` heads): Megatron's non-interleaved RoPE of ``x [s, heads,
    width]`` (strided over its first two dimensions) into the contiguous ``y``, with ``cos``/``sin`` ``[s,
    rot]``; columns from ``rot`` on pass through.  Column ``c`` of the first half takes its partner ``c + rot/2``
    with a minus, of the second half ``c - rot/2`` with a plus:

    - forward: ``y[c] = x[c] cos[c] ∓ x[p] sin[c]``;
    - ``BACKWARD`` (``x`` is the output gradient): the rotation transposed, ``y[c] = x[c] cos[c] ± x[p] sin[p]``.

    fp32 arithmetic, rounded once, as the compiled kernel."""
    pos = tl.program_id(0).to(tl.int64)  # offsets in int64: tokens x heads x width can pass 2**31
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    cols = tl.arange(0, BLOCK)
    half = rot // 2
    first = cols < half
    rotated = cols < rot
    partner = tl.where(first, cols + half, cols - half)
    inside = (head < heads)[:, None] & (cols < width)[None, :]
    turned = (head < heads)[:, None] & rotated[None, :]
    rows = x_ptr + pos * x_pos + head.to(tl.int64)[:, None] * x_head
    x = tl.load(rows + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    x_partner = tl.load(rows + partner[None, :], mask=turned, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + pos * rot + cols, mask=rotated, other=1.0).to(tl.float32)
    if BACKWARD:
        sin = tl.load(sin_ptr + pos * rot + partner, mask=rotated, other=0.0).to(tl.float32)
        sign = tl.where(first, 1.0, -1.0)
    else:
        sin = tl.load(sin_ptr + pos * rot + cols, mask=rotated, other=0.0).to(tl.float32)
        sign = tl.where(first, -1.0, 1.0)
    y = x * cos[None, :] + (sign * sin)[None, :] * x_partner
    out = y_ptr + (pos * heads + head.to(tl.int64))[:, None] * width + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=inside)
