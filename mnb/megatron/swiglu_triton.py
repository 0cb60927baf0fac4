"""The Triton kernels of :mod:`mnb.megatron.swiglu_kernels` (which says why, and calls them).

Imported only where Triton is (torch's CUDA wheels bring it).  Under ``TRITON_INTERPRET=1``, set before
Triton is first imported, they run on CPU tensors: how the tests run them.
"""

import triton
import triton.language as tl


@triton.jit
def swiglu_forward_kernel(y_ptr, out_ptr, width, y_row, out_row, BLOCK: tl.constexpr):
    """``out = silu(gate) * up`` of ``y = [gate | up]`` (each ``width`` wide), one program per (row, block of
    ``BLOCK`` columns); fp32 arithmetic, rounded once."""
    row = tl.program_id(0).to(tl.int64)  # offsets in int64: tokens x 2 x ffn can pass 2**31
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(y_ptr + row * y_row + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + row * y_row + width + cols, mask=inside, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * out_row + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def swiglu_backward_kernel(g_ptr, y_ptr, dy_ptr, width, g_row, y_row, dy_row, BLOCK: tl.constexpr):
    """``dy = [g * up * s * (1 + gate * (1 - s)) | g * gate * s]`` with ``s = sigmoid(gate)``: both halves of
    the input gradient from one read of the output gradient and of ``y``; fp32, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    g = tl.load(g_ptr + row * g_row + cols, mask=inside, other=0.0).to(tl.float32)
    gate = tl.load(y_ptr + row * y_row + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + row * y_row + width + cols, mask=inside, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-gate))
    d_gate = g * up * s * (1.0 + gate * (1.0 - s))
    d_up = g * gate * s
    tl.store(dy_ptr + row * dy_row + cols, d_gate.to(dy_ptr.dtype.element_ty), mask=inside)
    tl.store(dy_ptr + row * dy_row + width + cols, d_up.to(dy_ptr.dtype.element_ty), mask=inside)
