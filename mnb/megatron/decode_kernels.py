"""Triton kernels of the decode step (issue 40): the attention of one new position, RMSNorm of a few rows,
and the linear layers of one row.

Why: at batch 1 a llama-1b token is about 350 kernels, and each small one costs its launch
(1.5–4 µs inside a CUDA graph) whatever it computes.  A layer's decode attention was eight of
them (two cache writes, the scores GEMM, the mask add, softmax, a cast, the values GEMM, the
output copy) reading the whole cache bucket; :func:`decode_attention` is one kernel that reads
each row's keys only up to its own position.  Torch's RMSNorm of one 2,048-wide row took 3.6 µs
(33 of them a token); :func:`rms_norm` is one kernel of about the launch's cost.  cuBLAS's one-row
GEMMs read small weights at a third to a half of the bandwidth; with :func:`linear` a llama-1b token's
65 linears took 747 µs on an H200 against cuBLAS's 870 (every weight once at the copy bandwidth: 592).

Arithmetic: fp32 throughout (scores, an online softmax as in flash-decoding, the weighted sum of
values), rounded once to the model's dtype at the end; where the eager path rounded the scores
and probabilities to bf16 in between, this is closer to exact, not bit for bit the same.
:func:`rms_norm` rounds once, as torch's ``F.rms_norm`` does (normalised and weighted in fp32).

Used by :mod:`mnb.megatron.decode_graphs` on CUDA ranks where :func:`runs_on` (Triton is part of
torch's CUDA wheels); CPU ranks never call these.  ``TRITON_INTERPRET=1`` in a process's environment
from its start runs them on CPU tensors (the tests do).  The kernels themselves are in
:mod:`mnb.megatron.decode_triton`, imported on first use (it needs Triton).
"""

from __future__ import annotations

import functools

import torch

from mnb.megatron import norm_kernels
from mnb.megatron.triton_support import interpreted, next_power_of_two, probe, serves

BLOCK_KEYS = 64
"""Cached keys and values read per loop step of the attention kernel."""
GEMV_ROWS, GEMV_COLUMNS, GEMV_WARPS = 8, 1024, 8
"""Weight rows per program of :func:`linear`, columns read per loop step, warps per program: the
configuration bench/gemm_sweep.py measured on llama-1b's weights at 4.8–117.5 µs where cuBLAS took
6.1–126 (2026-12-04)."""


def runs_on(device: torch.device) -> bool:
    """Whether these kernels serve tensors on ``device``: CUDA with Triton, or any device with Triton's
    interpreter on (``TRITON_INTERPRET=1``, how the CPU tests run them); and each kernel, run once here on
    tiny tensors, worked (Triton imports without a C compiler or a supported GPU, then fails to build)."""
    return serves(device) and _probe(str(device), interpreted())


@functools.lru_cache(maxsize=None)
def _probe(device: str, interpreted: bool) -> bool:
    """Each kernel once on tiny tensors, once per device and process (:func:`triton_support.probe`)."""
    def check(at: torch.device) -> None:
        x = torch.ones(1, 1, 2, 16, device=at)
        cache = torch.zeros(1, 1, 4, 16, device=at)
        where = torch.ones(1, 1, dtype=torch.long, device=at)
        decode_attention(x, x[:, :, :1], x[:, :, :1], cache, cache.clone(), where, None, 0.25)
        rms_norm(x, torch.ones(16, device=at), 1e-5)
        linear(torch.ones(1, 16, dtype=torch.bfloat16, device=at), torch.ones(8, 16, dtype=torch.bfloat16, device=at))

    return probe("decode kernels", device, check, "decoding with torch's ops")


def _kernels():
    """The Triton kernels (:mod:`mnb.megatron.decode_triton`, imported on first use: it needs Triton)."""
    from mnb.megatron import decode_triton

    return decode_triton.attention_kernel, decode_triton.gemv_kernel


def decode_attention(query, key, value, keys, values, where, bias, scale: float, sdpa: bool = False):
    """:func:`mnb.megatron.decode_graphs.decode_attention`'s contract in one kernel.

    ``query [1, b, heads, dim]``, ``key/value [1, b, groups, dim]`` (rotated), ``keys/values
    [b, groups, positions, dim]`` (the static cache), ``where [b, 1]`` each row's new position.
    Writes the new key and value at ``where`` and returns ``[1, b, heads * dim]``.  ``bias`` and
    ``sdpa`` are unused: the kernel masks by ``where`` itself."""
    _, b, heads, dim = query.shape
    groups = key.shape[2]
    q, k, v = query[0], key[0], value[0]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if keys.stride(-1) != 1 or values.stride() != keys.stride():
        raise ValueError("the decode cache must be contiguous in its last dimension, keys and values alike")
    if where.dim() != 2 or where.shape[1] != 1 or where.stride(0) != 1:
        where = where.reshape(-1, 1).contiguous()
    out = torch.empty(b, heads, dim, dtype=query.dtype, device=query.device)
    attention_kernel = _kernels()[0]
    attention_kernel[(b, heads)](
        q, k, v, keys, values, where, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), out.stride(0), out.stride(1), float(scale),
        REP=heads // groups, DIM=dim, BLOCK_D=next_power_of_two(dim), BLOCK_N=BLOCK_KEYS, num_warps=4)
    return out.view(1, b, heads * dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (width,), weight, eps)`` over the last dimension in one kernel (a tile of rows a program):
    :mod:`mnb.megatron.norm_kernels`' forward, which keeps nothing for a backward here."""
    return norm_kernels.forward(x, weight, eps)


def one_row(x: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` takes ``x @ weight.T (+ bias)``: one contiguous row of bf16/fp16, a 2-D weight of
    its dtype whose rows are contiguous, a contiguous bias (or none)."""
    return (x is not None and weight is not None and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.dim() == 2 and x.numel() == x.shape[-1] == weight.shape[1]
            and weight.stride(1) == 1 and x.is_contiguous()
            and (bias is None or bias.dim() == 1 and bias.is_contiguous()))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one row ``x`` (:func:`one_row`) in one kernel.

    Why: cuBLAS's one-row kernels cost about 6 µs however small the weight (llama-1b's qkv, proj and
    fc2 read at 1.4–2.4 TB/s of the GPU's 4.3); this one reads each weight row once, whole."""
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    gemv_kernel = _kernels()[1]
    gemv_kernel[(-(-n // GEMV_ROWS),)](weight, x, bias if bias is not None else weight, out, n, k, weight.stride(0),
                                       HAS_BIAS=bias is not None, BLOCK_N=GEMV_ROWS, BLOCK_K=GEMV_COLUMNS,
                                       num_warps=GEMV_WARPS)
    return out
