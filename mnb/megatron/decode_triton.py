"""The Triton kernels of :mod:`mnb.megatron.decode_kernels` (which says why, and calls them).

Imported only where Triton is (torch's CUDA wheels bring it).  Under ``TRITON_INTERPRET=1``, set before
Triton is first imported, they run on CPU tensors: how the tests run them.
"""

import triton
import triton.language as tl


@triton.jit
def attention_kernel(q_ptr, k_ptr, v_ptr, keys_ptr, values_ptr, where_ptr, out_ptr,
                     q_row, q_head, k_row, k_group, v_row, v_group,
                     c_row, c_group, c_pos, o_row, o_head, scale,
                     REP: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (row, query head): an online softmax over its group's cached keys 0..p-1 (p: the
    row's new position, read from ``where``), then the new key itself, which the group's first head
    also writes into the cache (the others never read position p from it, so no program waits)."""
    row = tl.program_id(0).to(tl.int64)  # offsets in int64: a cache can pass 2**31 elements
    head = tl.program_id(1).to(tl.int64)
    group = head // REP
    d = tl.arange(0, BLOCK_D)
    in_dim = d < DIM
    q = tl.load(q_ptr + row * q_row + head * q_head + d, mask=in_dim, other=0.0).to(tl.float32)
    k_new = tl.load(k_ptr + row * k_row + group * k_group + d, mask=in_dim, other=0.0)
    v_new = tl.load(v_ptr + row * v_row + group * v_group + d, mask=in_dim, other=0.0)
    p = tl.load(where_ptr + row)
    cache = row * c_row + group * c_group
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.full([1], 0.0, tl.float32)
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    for start in range(0, p, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        seen = n < p
        where = cache + n[:, None] * c_pos + d[None, :]
        both = seen[:, None] & in_dim[None, :]
        k = tl.load(keys_ptr + where, mask=both, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        shrink = tl.exp(m - m_new)
        weights = tl.exp(s - m_new)
        v = tl.load(values_ptr + where, mask=both, other=0.0).to(tl.float32)
        total = total * shrink + tl.sum(weights, axis=0)
        acc = acc * shrink + tl.sum(weights[:, None] * v, axis=0)
        m = m_new
    s_new = tl.sum(k_new.to(tl.float32) * q, axis=0) * scale
    m_new = tl.maximum(m, s_new)
    shrink = tl.exp(m - m_new)
    weight = tl.exp(s_new - m_new)
    total = total * shrink + weight
    acc = acc * shrink + weight * v_new.to(tl.float32)
    tl.store(out_ptr + row * o_row + head * o_head + d, (acc / total).to(out_ptr.dtype.element_ty),
             mask=in_dim)
    writer = in_dim & (head % REP == 0)  # the group's first head writes the new key and value
    tl.store(keys_ptr + cache + p * c_pos + d, k_new, mask=writer)
    tl.store(values_ptr + cache + p * c_pos + d, v_new, mask=writer)


@triton.jit
def gemv_kernel(w_ptr, x_ptr, b_ptr, y_ptr, N, K, w_row,
                HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``y = W x (+ b)`` for one row ``x``: one program per BLOCK_N whole rows of ``W`` (no split over K),
    fp32 sums, rounded once."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # int64: vocab x hidden can pass 2**31
    in_rows = rows < N
    acc = tl.full([BLOCK_N], 0.0, tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        in_cols = cols < K
        w = tl.load(w_ptr + rows[:, None] * w_row + cols[None, :], mask=in_rows[:, None] & in_cols[None, :],
                    other=0.0)
        x = tl.load(x_ptr + cols, mask=in_cols, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :].to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=in_rows)
