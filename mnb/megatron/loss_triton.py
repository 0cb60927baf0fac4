"""The Triton kernels of :mod:`mnb.megatron.loss_kernels` (which says why, and calls them).

Imported only where Triton is (torch's CUDA wheels bring it).  Under ``TRITON_INTERPRET=1``, set before
Triton is first imported, they run on CPU tensors: how the tests run them.
"""

import triton
import triton.language as tl


@triton.jit
def cross_entropy_forward_kernel(logits_ptr, target_ptr, max_ptr, sum_ptr, picked_ptr, row_stride, width, start,
                                 BLOCK: tl.constexpr):
    """One program per token, in one pass over its ``width`` logits (this tp rank's part of the vocabulary,
    from id ``start``): their max ``m``, ``Σ exp(logit - m)`` (the running sum rescaled whenever the max
    grows: an online softmax), and the logit of the token's target when it is in this part (0 when not).
    fp32 arithmetic."""
    row = tl.program_id(0).to(tl.int64)  # offsets in int64: tokens x vocabulary passes 2**31
    base = logits_ptr + row * row_stride
    # the lowest finite fp32, not -inf: a block whose logits are all -inf (masked by a user) then adds
    # exp(-inf) = 0 to the sum instead of exp(-inf + inf) = nan; a row of nothing but -inf is nan, as torch's
    top = -3.4028234663852886e38
    total = 0.0
    for first in range(0, width, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < width, other=-float("inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, axis=0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
        top = new_top
    local = tl.load(target_ptr + row) - start
    here = (local >= 0) & (local < width)
    picked = tl.load(base + tl.where(here, local, 0), mask=here, other=0.0).to(tl.float32)
    tl.store(max_ptr + row, top)
    tl.store(sum_ptr + row, total)
    tl.store(picked_ptr + row, tl.where(here, picked, 0.0))


@triton.jit
def cross_entropy_backward_kernel(logits_ptr, target_ptr, max_ptr, sum_ptr, grad_loss_ptr, grad_ptr,
                                  row_stride, width, start, BLOCK: tl.constexpr):
    """One program per (token, block of ``BLOCK`` logits): ``(softmax - one_hot(target)) * grad_loss`` from
    the global max and sum of exp the forward kept, written in the logits' dtype; fp32 arithmetic."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    top = tl.load(max_ptr + row)
    total = tl.load(sum_ptr + row)
    scale = tl.load(grad_loss_ptr + row)
    local = tl.load(target_ptr + row) - start
    softmax = tl.exp(x - top) / total
    grad = (softmax - tl.where(cols == local, 1.0, 0.0)) * scale
    tl.store(grad_ptr + row * width + cols, grad.to(grad_ptr.dtype.element_ty), mask=inside)
