"""Fused kernels for GPU ranks without Transformer Engine or apex: mnb's own Triton kernels, or ``torch.compile``'s.

Why: with the local spec every elementwise step is its own kernel.  For a Llama
shape the costly ones are memory-bound passes over large tensors:

- the loss.  Megatron's ``vocab_parallel_cross_entropy`` upcasts the
  ``[s, b, vocab]`` logits to fp32 and makes about ten passes over them, then
  keeps an fp32 softmax for backward (8.4 GB at llama-1b, micro batch 8, seq 2048).
  :func:`vocab_parallel_cross_entropy` here keeps the bf16 logits instead of an
  fp32 copy and does the same fp32 arithmetic (max, sum of exp, target logit;
  all-reduced over tp).
- RoPE.  Megatron's unfused RoPE is six kernels per tensor per direction;
  Megatron leaves a slot for a fused one (``rope_utils.fused_apply_rotary_pos_emb``,
  TE's) used when ``apply_rope_fusion`` is set.  Without TE :func:`install_rope`
  fills that slot with :func:`fused_rope`.
- SwiGLU.  :func:`swiglu`, one kernel each way, used by the local spec's dense
  MLP (:class:`mnb.megatron.spec.FusedSwiGLUMLP`).

Each runs, by default, as mnb's own Triton kernels where they run (GPU ranks with Triton:
:mod:`mnb.megatron.loss_kernels`, :mod:`mnb.megatron.rope_kernels`, :mod:`mnb.megatron.swiglu_kernels`),
from a model's first step and compiling nothing.  Inductor's compiled kernels of the same arithmetic
serve where those do not: a kernel module switched off (``enabled = False``) or failing its probe,
under ``torch.compile`` (a compiled decode step), and when a caller asks with ``compiled=``.

``fusions="auto"`` (the default of ``mnb.gpt``) turns these on for CUDA ranks
with Triton, and off on CPU ranks (where ``torch.compile`` would need a C++
toolchain and minutes of compiling, and the parity tests want Megatron's own
unfused arithmetic).  Where a fused ``mnb.gpt`` needs compiled kernels, it starts compiling
them in a background thread (:func:`warm_up`, seconds) and its first training steps run
the same arithmetic eagerly until they are ready (:mod:`mnb.megatron.background_compile`), on blocks
of tokens (:func:`by_rows`) so that they need no more memory than the compiled kernels;
later models and layouts reuse them.
"""

from __future__ import annotations

import functools
import threading
import weakref
import math
import os
import time
from typing import Any, Callable

import torch

from mnb.megatron import loss_kernels, rope_kernels, swiglu_kernels

AUTO = "auto"
COMPILE_ON_CPU = False
"""Tests only: compile on CPU ranks too (Inductor's C++ backend), to exercise the GPU path."""

_warm_lock = threading.Lock()
"""One warm-up at a time: the pool's background compile and a model's own (mnb.worker.boot)."""


run_eager: "Callable[[], bool] | None" = None
"""Set by :mod:`mnb.megatron.background_compile` while a model's kernels compile in a background
thread: whether the fused ops run their eager (unfused, same arithmetic) version right now."""
calls = {"compiled": 0, "eager": 0}
"""How many fused-op calls ran compiled and how many eagerly (tests and diagnostics)."""


def compiled_by_default(t: torch.Tensor) -> bool:
    """Whether a fused op given ``t`` runs its compiled kernel now: on a GPU (or ``COMPILE_ON_CPU``), unless
    the kernels still compile in the background (:data:`run_eager`)."""
    eager = run_eager
    return (t.is_cuda or COMPILE_ON_CPU) and not (eager is not None and eager())


@functools.lru_cache(maxsize=None)
def _compiled(fn, dynamic: bool | None):
    _inline_while_another_thread_traces()
    return torch.compile(fn, dynamic=dynamic)


def _inline_while_another_thread_traces() -> None:
    """A compiled kernel called while another thread compiles runs eagerly instead of raising.

    Why: FX's "am I tracing" flag is one process-wide global, not per thread.  While the
    background compile (or the pool's preset warm-up) traces a graph, a compiled kernel called
    on the training thread saw the flag and Dynamo raised "Detected that you are using FX to
    symbolically trace a dynamo-optimized function" (the first llama-1b ``mnb.train`` on a
    fresh H200, BENCHMARKS.md).  With ``error_on_nested_fx_trace`` off, Dynamo runs the
    function itself for that call: the eager version of the same arithmetic.
    """
    config = torch._dynamo.config
    if getattr(config, "error_on_nested_fx_trace", None):
        config.error_on_nested_fx_trace = False


def _kernel(fn, compiled: bool, *, dynamic: bool | None = True):
    """``fn``'s compiled version (one per function and process), or ``fn`` eagerly, by row blocks."""
    calls["compiled" if compiled else "eager"] += 1
    return _compiled(fn, dynamic) if compiled else functools.partial(by_rows, fn)


EAGER_BLOCK_BYTES = 256 * 2**20
"""The eager (unfused) ops work on blocks of rows (tokens) whose fp32 copy is about this large."""


def by_rows(fn, *tensors: torch.Tensor):
    """``fn(*tensors)`` computed on blocks of rows (the first dimension, which all share), its
    outputs written into tensors allocated once: what the eager ops run while kernels compile.

    Why: a compiled kernel keeps its fp32 arithmetic in registers; the same arithmetic op by op
    makes fp32 temporaries the size of its input, several at once.  For the loss at llama-3b,
    micro batch 8, seq 2048 that was three or four fp32 copies of the ``[tokens, vocab]`` logits
    (8.4 GB each) in backward, and a fresh H200's first run ran out of memory at its second step
    while its kernels compiled (issue 39).  By blocks the temporaries are a few
    :data:`EAGER_BLOCK_BYTES`; every row's arithmetic is unchanged, so the results are the same.
    """
    rows = tensors[0].shape[0]
    row_bytes = 4 * max(max(1, t[:1].numel()) for t in tensors)
    block = max(1, EAGER_BLOCK_BYTES // row_bytes)
    if rows <= block:
        return fn(*tensors)
    outs = single = None
    for start in range(0, rows, block):  # a tensor of one row (a broadcast table) is passed whole
        parts = fn(*(t[start:start + block] if t.shape[0] == rows else t for t in tensors))
        if outs is None:
            single = isinstance(parts, torch.Tensor)
            outs = tuple(torch.empty((rows, *p.shape[1:]), dtype=p.dtype, device=p.device)
                         for p in ((parts,) if single else parts))
        for out, part in zip(outs, (parts,) if single else parts):
            out[start:start + block] = part
        del parts
    return outs[0] if single else outs


def warm_up(device: torch.device, dtype: torch.dtype = torch.bfloat16, *,
            swiglu_widths: tuple[int, ...] = (), vocab_widths: tuple[int, ...] = (),
            rope_layouts: tuple[tuple[int, int], ...] = (), announce: bool = True) -> float:
    """Compile the fused kernels for a model's shapes on small tensors; the seconds it took.

    Each kernel is compiled for symbolic token counts (and heads per rank) but fixed widths,
    which is what makes it fast (see :func:`_shape_marks`), so a warm-up names the widths:
    ``swiglu_widths`` (fc1 outputs per rank), ``vocab_widths`` (padded vocabulary per rank)
    and ``rope_layouts`` (``(head dimension, query heads per group)``: the fused-qkv layout
    behind RoPE's key).  :func:`model_shapes` gives them for a model under every tp the pool
    can take, so changing tp later compiles nothing.  Dynamo guards on the shapes of views'
    bases and specialises size-1 dimensions, so the warm-up feeds the kernels exactly what
    Megatron does (the fused-qkv view chain for RoPE, the ``[s, b, ...]`` tensors behind the
    flattened loss and SwiGLU inputs), at micro batch 1 and 2 and with one query group per
    rank, with sizes that coincide nowhere.  What was compiled once in this process is not
    compiled again.
    Rank 0 says what it is doing, as the first time takes seconds (``announce``; the pool's
    own background compile, started when a CUDA rank is ready, is silent).  A call while
    another thread compiles waits for it, then compiles only what is still missing.
    """
    start = time.perf_counter()
    if announce and _warm_lock.locked() and _is_first_rank():
        print("mnb: waiting for the fused kernels the pool started compiling when it was ready", flush=True)
    with _warm_lock:
        _warm_up(device, dtype, swiglu_widths, vocab_widths, rope_layouts, announce)
    return time.perf_counter() - start


def model_shapes(ffn_hidden_size: int | None, padded_vocab: "Callable[[int], int] | None",
                 rope_layout: tuple[int, int] | None, ceiling: int) -> dict:
    """``warm_up``'s keyword arguments for a model under every tp dividing ``ceiling``: its SwiGLU
    (``ffn_hidden_size``), loss (``padded_vocab(tp)``: the vocabulary after Megatron's padding for that tp)
    and RoPE (``(head dimension, query heads per group)``); None leaves that kernel out."""
    tps = [tp for tp in range(1, ceiling + 1) if ceiling % tp == 0]
    return {
        "swiglu_widths": swiglu_widths(ffn_hidden_size, ceiling) if ffn_hidden_size else (),
        "vocab_widths": tuple(dict.fromkeys(padded_vocab(tp) // tp for tp in tps)) if padded_vocab else (),
        "rope_layouts": (tuple(rope_layout),) if rope_layout else (),
    }


def _is_first_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


_warm: set = set()
"""What this process compiled: ("swiglu", width, dtype), ("loss", width, dtype), ("rope", layout, dtype)."""


def warm_keys(dtype: torch.dtype = torch.bfloat16, *, swiglu_widths=(), vocab_widths=(), rope_layouts=()) -> list:
    """What :func:`warm_up` with these arguments compiles, as keys of :func:`is_warm`."""
    return ([("swiglu", w, dtype) for w in dict.fromkeys(swiglu_widths)]
            + [("loss", v, dtype) for v in dict.fromkeys(vocab_widths)]
            + [("rope", tuple(layout), dtype) for layout in dict.fromkeys(map(tuple, rope_layouts))])


def compiled_kinds(keys) -> str:
    """What ``keys`` (of :func:`warm_keys`) compile, in words: ``"loss, RoPE and SwiGLU"``."""
    names = list(dict.fromkeys({"loss": "loss", "rope": "RoPE", "swiglu": "SwiGLU"}[key[0]] for key in keys))
    return " and ".join(filter(None, (", ".join(names[:-1]), names[-1] if names else "")))


def is_warm(keys) -> bool:
    """Whether every kernel ``keys`` names was compiled in this process (by any thread)."""
    return all(key in _warm for key in keys)


def _warm_up(device: torch.device, dtype: torch.dtype, swiglu_widths, vocab_widths, rope_layouts,
             announce: bool) -> None:
    todo = warm_keys(dtype, swiglu_widths=swiglu_widths, vocab_widths=vocab_widths, rope_layouts=rope_layouts)
    todo = [key for key in todo if key not in _warm]
    if not todo:
        return
    if announce and _is_first_rank():
        print(f"mnb: compiling the fused {compiled_kinds(todo)} kernels for this model's shapes (once per "
              "pool process; mnb.gpt(..., fusions=False) skips them)", flush=True)
    # A private generator: the warm-up may run beside a model's initialisation (the pool's
    # background compile) and must not move the seeded RNG streams training uses.
    rng = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad, generator=rng)

    # (seq, micro batch, query groups on this rank): the last gives RoPE's key [s, 1, 1, hn],
    # micro batch 1 with one group per tp rank, which flattens to a size-1 dimension.
    for seq, batch, groups in ((11, 2, 3), (13, 1, 3), (17, 1, 1)):
        for kind, size, _ in todo:
            if kind == "swiglu":
                swiglu(randn(seq, batch, size), compiled=True).float().sum().backward()
            elif kind == "loss":
                labels = torch.randint(0, size, (batch, seq), device=device, generator=rng)
                language_model_loss(labels, randn(seq, batch, size), None, compiled=True).sum().backward()
            else:  # SelfAttention: fc output [s, b, ng * (np/ng + 2) * hn] -> view -> split; query reshaped.
                head, per_group = size
                mixed = randn(seq, batch, groups * (per_group + 2) * head)
                query, key, _ = mixed.view(seq, batch, groups, (per_group + 2) * head).split(
                    [per_group * head, head, head], dim=3)
                query = query.reshape(seq, batch, -1, head)
                freqs = torch.randn(seq, 1, 1, head, device=device, generator=rng)
                rotated = fused_rope(query, freqs, compiled=True), fused_rope(key, freqs, compiled=True)
                sum(r.float().sum() for r in rotated).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _warm.update(todo)


@functools.lru_cache(maxsize=1)
def compile_available() -> bool:
    """True when ``torch.compile`` can build GPU kernels here (CUDA and Triton)."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(has_triton())


def resolve(fusions: bool | str, device: torch.device) -> bool:
    """Turn ``mnb.gpt(fusions=...)`` into on/off for this rank, refusing the impossible."""
    if fusions != AUTO and not isinstance(fusions, bool):
        raise ValueError(f"fusions must be 'auto', True or False, got {fusions!r}")
    if COMPILE_ON_CPU and fusions is not False:
        return True
    if fusions == AUTO:
        return device.type == "cuda" and compile_available()
    if fusions and not (device.type == "cuda" and compile_available()):
        raise ValueError(
            "fusions=True needs CUDA ranks with Triton (torch.compile's GPU backend); "
            f"this rank runs on {device.type}"
            + ("" if device.type != "cuda" else " without Triton")
            + ": use fusions='auto' or False"
        )
    return fusions


def tp_ceiling() -> int:
    """The tp sizes worth preparing for divide this: the ranks of one node that the whole pool shares."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return math.gcd(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def swiglu_widths(ffn_hidden_size: int, ceiling: int) -> tuple[int, ...]:
    """fc1 output widths of a SwiGLU MLP under every tp dividing ``ceiling`` (and the ffn).

    Compiled together at a model's first warm-up, so changing tp later in the
    live pool compiles nothing (measured on an H200: 1.6 s for a new width).
    """
    return tuple(2 * ffn_hidden_size // tp for tp in range(1, ceiling + 1)
                 if ceiling % tp == 0 and ffn_hidden_size % tp == 0)


def swiglu_applies(config) -> bool:
    """True when a dense MLP's activation is exactly what :func:`swiglu` computes."""
    return (
        config.gated_linear_unit
        and config.activation_func is torch.nn.functional.silu
        and not config.add_bias_linear
        and not getattr(config, "use_te_activation_func", False)
        and getattr(config, "activation_func_clamp_value", None) is None
        and not getattr(config, "glu_linear_offset", 0.0)
    )


def _not_a_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a tensor that is not a view (no autograd; use inside Functions).

    Dynamo guards on the shapes and strides of a view's base, which differ
    between Megatron's tensors and any warm-up (and specialise size-1 micro
    batches); a plain tensor over the same storage is guarded on its own shape.
    """
    if t._base is None:
        return t
    plain = torch.empty((0,), dtype=t.dtype, device=t.device)
    return plain.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


# ----------------------------------------------------------------------------- loss

def _logits_max(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().amax(dim=-1)


def _sum_exp_and_target(logits, logits_max, local_target, in_range):
    shifted = logits.float() - logits_max.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    picked = torch.gather(shifted, -1, local_target.unsqueeze(-1)).squeeze(-1)
    return sum_exp, torch.where(in_range, picked, torch.zeros_like(picked))


def _logits_grad(logits, logits_max, sum_exp, local_target, in_range, grad_loss):
    softmax = (logits.float() - logits_max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)
    columns = torch.arange(logits.shape[-1], device=logits.device)
    target = (columns == local_target.unsqueeze(-1)) & in_range.unsqueeze(-1)
    return ((softmax - target.float()) * grad_loss.unsqueeze(-1)).to(logits.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Works on ``[tokens, vocab/tp]``: with micro batch 1 a ``[s, 1, v]`` shape would make
    the compiled kernels specialise (and recompile) on the size-1 dimension."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, compiled):
        logits = _not_a_view(logits)
        tp_size = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        if compiled:  # one compile per vocabulary width on a rank (warm_up's vocab_widths)
            _tokens_dynamic(logits)
            _shape_marks(target, dynamic=(0,))
        logits_max = _kernel(_logits_max, compiled, dynamic=None)(logits)
        if tp_size > 1:
            torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
        part = logits.shape[-1]
        start = part * (torch.distributed.get_rank(tp_group) if tp_size > 1 else 0)
        in_range = (target >= start) & (target < start + part)
        local_target = torch.where(in_range, target - start, torch.zeros_like(target))
        if compiled:
            for t in (logits_max, local_target, in_range):
                _shape_marks(t, dynamic=(0,))
        sum_exp, predicted = _kernel(_sum_exp_and_target, compiled, dynamic=None)(
            logits, logits_max, local_target, in_range)
        if tp_size > 1:
            both = torch.stack((sum_exp, predicted))
            torch.distributed.all_reduce(both, group=tp_group)
            sum_exp, predicted = both[0], both[1]
        ctx.compiled = compiled
        ctx.save_for_backward(logits, logits_max, sum_exp, local_target, in_range)
        return torch.log(sum_exp) - predicted

    @staticmethod
    def backward(ctx, grad_loss):
        logits, *rows = (_not_a_view(t) for t in ctx.saved_tensors)
        grad_loss = _not_a_view(grad_loss.contiguous())
        if ctx.compiled:
            _tokens_dynamic(logits)
            for t in (*rows, grad_loss):
                _shape_marks(t, dynamic=(0,))
        grad = _kernel(_logits_grad, ctx.compiled, dynamic=None)(logits, *rows, grad_loss)
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None,
                                 *, compiled: bool | None = None) -> torch.Tensor:
    """Per-token cross entropy of ``logits [s, b, vocab/tp]`` against ``target [s, b]``.

    The arithmetic of Megatron's ``vocab_parallel_cross_entropy`` (fp32 max,
    sum of exp and target logit, all-reduced over the tp group), without its
    fp32 copy of the logits.  Returns fp32 ``[s, b]``; the gradient has the
    logits' dtype.  ``compiled`` defaults to whether the logits are on a GPU.
    By default, where mnb's Triton loss runs (:mod:`mnb.megatron.loss_kernels`:
    GPU ranks with Triton), that is what runs, compiling nothing.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    if compiled is None and not torch.compiler.is_compiling() and loss_kernels.applies(flat):
        return loss_kernels.cross_entropy(flat, target.reshape(-1), tp_group).view(target.shape)
    compiled = compiled_by_default(logits) if compiled is None else compiled
    loss = _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), tp_group, compiled)
    return loss.view(target.shape)


def language_model_loss(labels: torch.Tensor, logits: torch.Tensor, tp_group, *,
                        compiled: bool | None = None) -> torch.Tensor:
    """``GPTModel.compute_language_model_loss`` with :func:`vocab_parallel_cross_entropy`.

    labels ``[b, s]``, logits ``[s, b, vocab/tp]``; returns ``[b, s]``, as Megatron's.
    """
    labels = labels.transpose(0, 1).contiguous()
    loss = vocab_parallel_cross_entropy(logits, labels, tp_group, compiled=compiled)
    return loss.transpose(0, 1).contiguous()


# ----------------------------------------------------------------------------- SwiGLU

def _swiglu(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _swiglu_grad(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    gate, up = y.float().chunk(2, dim=-1)
    grad = grad.float()
    sig = torch.sigmoid(gate)
    d_gate = grad * up * sig * (1 + gate * (1 - sig))
    return torch.cat((d_gate, grad * gate * sig), dim=-1).to(y.dtype)


def _tokens_dynamic(*tensors: torch.Tensor) -> None:
    """Compile once for every token count, but specialise on the width (fast indexing)."""
    for t in tensors:
        _shape_marks(t, dynamic=(0,), static=(1,))


def _shape_marks(t: torch.Tensor, dynamic: tuple[int, ...], static: tuple[int, ...] = ()) -> None:
    """Symbolic sizes where they vary (tokens, heads per rank), fixed ones where they do not.

    A symbolic width makes Inductor index with divisions by a runtime size: on an H200 the
    loss gradient, RoPE and SwiGLU kernels ran 2.8-9x below memory bandwidth with symbolic
    widths.  Size-1 dimensions are left to Dynamo, which specialises them anyway.
    """
    for dim in dynamic:
        if t.shape[dim] > 1:
            torch._dynamo.mark_dynamic(t, dim)
    for dim in static:
        torch._dynamo.mark_static(t, dim)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, compiled):
        ctx.compiled = compiled
        y = _not_a_view(y)
        ctx.save_for_backward(y)
        if compiled:
            _tokens_dynamic(y)
        return _kernel(_swiglu, compiled, dynamic=None)(y)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        grad = _not_a_view(grad.contiguous())
        if ctx.compiled:
            _tokens_dynamic(grad, y)
        return _kernel(_swiglu_grad, ctx.compiled, dynamic=None)(grad, y), None


def swiglu(x: torch.Tensor, *, compiled: bool | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [..., 2f]`` (gate first, as Megatron's fc1 lays it out).

    One kernel each way; the input is kept for backward, as Megatron's fused
    SwiGLU does.  Megatron's own (``bias_activation_fusion``) is compiled with
    automatic dynamic shapes: in a live pool the second layout or batch size
    recompiles it with a symbolic width, and its backward then ran 3x slower
    (measured on an H200).  Here the token count is symbolic and the width
    fixed: one compile per width, full speed.  ``compiled`` defaults to
    whether ``x`` is on a GPU.  By default, where mnb's Triton SwiGLU runs
    (:mod:`mnb.megatron.swiglu_kernels`: GPU ranks with Triton), that is what runs, from the first
    step and compiling nothing; under ``torch.compile`` (a compiled decode step) Inductor's.
    """
    if compiled is None and not torch.compiler.is_compiling() and swiglu_kernels.applies(x):
        return swiglu_kernels.swiglu(x)
    shape = x.shape
    compiled = compiled_by_default(x) if compiled is None else compiled
    out = _SwiGLU.apply(x.reshape(-1, shape[-1]), compiled)
    return out.view(*shape[:-1], shape[-1] // 2)


# ----------------------------------------------------------------------------- RoPE

def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Megatron's non-interleaved bshd RoPE (``_apply_rotary_pos_emb_bshd``, mscale 1)."""
    rot = cos.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x * cos + rotated * sin, rest), dim=-1)


def _rope_grad(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`_rope` with respect to ``t`` (the rotation transposed)."""
    rot = cos.shape[-1]
    g, rest = grad[..., :rot], grad[..., rot:]
    s1, s2 = (g * sin).chunk(2, dim=-1)
    return torch.cat((g * cos + torch.cat((s2, -s1), dim=-1), rest), dim=-1)


_rope_tables: tuple | None = None
"""The last freqs tensor's cos and sin: (weak reference, version, dtype, cos, sin)."""


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos(freqs)``, ``sin(freqs)`` in ``dtype``, computed once per freqs tensor.

    Megatron computes one freqs tensor per forward and passes it to every layer, for the
    query and the key; computing the tables inside the kernel repeated the transcendental
    functions for every head and micro batch row of every layer.  Eager ``torch.cos``/``sin``
    as Megatron's own unfused RoPE computes them, so the values are Megatron's.
    """
    global _rope_tables
    cached = _rope_tables
    if cached is not None and cached[0]() is freqs and cached[1] == freqs._version and cached[2] == dtype:
        return cached[3], cached[4]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    _rope_tables = (weakref.ref(freqs), freqs._version, dtype, cos, sin)
    return cos, sin


def _rope_marks(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Sequence and heads per rank symbolic, the head dimension fixed."""
    _shape_marks(t, dynamic=(0, 1), static=(2,))
    for table in (cos, sin):
        _shape_marks(table, dynamic=(0,), static=(2,))


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin, compiled):
        t, cos, sin = _not_a_view(t), _not_a_view(cos), _not_a_view(sin)
        ctx.compiled = compiled
        ctx.save_for_backward(cos, sin)
        if compiled:
            _rope_marks(t, cos, sin)
        return _kernel(_rope, compiled, dynamic=None)(t, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = (_not_a_view(x) for x in ctx.saved_tensors)
        grad = _not_a_view(grad.contiguous())
        if ctx.compiled:
            _rope_marks(grad, cos, sin)
        return _kernel(_rope_grad, ctx.compiled, dynamic=None)(grad, cos, sin), None, None, None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, *, interleaved: bool = False,
               compiled: bool | None = None, **_: Any) -> torch.Tensor:
    """Stand-in for TE's ``fused_apply_rotary_pos_emb(t, freqs, interleaved=...)`` (sbhd).

    ``[s, b, n, d]`` runs as ``[s, b*n, d]`` (a view for Megatron's query and key
    layouts), so micro batch 1 does not specialise the compiled kernel.  Forward
    and backward are one kernel each; ``compiled`` defaults to whether ``t`` is
    on a GPU.  By default, where mnb's Triton RoPE runs (:mod:`mnb.megatron.rope_kernels`:
    GPU ranks with Triton), that is what runs, compiling nothing.
    """
    if interleaved:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True)
    s, b, n, d = t.shape
    cos, sin = _cos_sin(freqs, t.dtype)
    flat = (freqs.shape[0], 1, freqs.shape[-1])
    rows, cos, sin = t.reshape(s, b * n, d), cos.reshape(flat), sin.reshape(flat)
    if compiled is None and not torch.compiler.is_compiling() and rope_kernels.applies(rows, cos):
        return rope_kernels.rope(rows, cos, sin).view(s, b, n, d)
    compiled = compiled_by_default(t) if compiled is None else compiled
    return _RoPE.apply(rows, cos, sin, compiled).view(s, b, n, d)


def install_rope() -> bool:
    """Fill Megatron's fused-RoPE slot when Transformer Engine has not; True if a fused RoPE is there."""
    from megatron.core.models.common.embeddings import rope_utils

    if getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    return rope_utils.fused_apply_rotary_pos_emb is not None
