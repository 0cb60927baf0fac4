"""Decoding at the GPU's speed (issue 40): a static KV cache and the decode step as a CUDA graph.

Used by :func:`mnb.generate` on CUDA ranks (CPU ranks keep :func:`mnb.megatron.generate.decode`).
The model's own Megatron modules run every step (embedding, norms, qkv, RoPE, projections, MLP or
MoE, LoRA adapters, tp collectives); only the core attention of each layer is swapped, for the
call, for :class:`CachedAttention`:

- **static KV cache**: per layer ``[batch, groups, positions, head_dim]``, sized by a bucket of
  the call (batch rounded up to a power of two, positions to a multiple of :data:`LENGTH_STEP`)
  and kept with its graphs for later calls of that size.
- **prefill**: the prompts, right-padded to the longest, in one causal pass
  (``scaled_dot_product_attention``); each prompt's first token comes from its own last
  position, and decoding continues each prompt at its own position, so padding is never
  attended to and nothing is recomputed.
- **decode step**: one new token per prompt at per-prompt positions (a device tensor); attention
  is one of :mod:`mnb.megatron.decode_kernels`' Triton kernels where Triton runs (each row's keys up
  to its own position, the loop bound read on the device; RMSNorm and one-row linears are its kernels
  too: :data:`own_kernels`), else two batched matmuls over the whole cache with a ``key <= position``
  mask; either way no kernel plan depends on the key length. Query and key are rotated together (RoPE: three kernels a
  layer, bit for bit Megatron's unfused ten), the sampled tokens are written where the next step
  reads them, and one add advances every position: fewer kernels per token, the same results.
  The step (embedding .. sampling, and with pp = 1 the advance of tokens, positions and the
  output buffer) is captured once per bucket and virtual stage with
  ``torch.cuda.graph`` and replayed per token: no host work per token but ``replay()``.
  With tp > 1 the tp all-reduces/all-gathers are NCCL calls inside the graph; with pp > 1 each
  stage has its graph, hidden states go point to point between replays and the last stage's
  tokens reach every stage with one all-reduce over the pipeline group per token.
- **sampling on the GPU**: greedy (argmax of the fp32 logits) or temperature / top-k / top-p with
  one uniform draw per prompt and step from a CUDA generator seeded with ``seed`` (the same on
  every rank, so every tp/dp rank picks the same token without a collective).
- **host sync every** :data:`SYNC_EVERY` **tokens**: the new tokens come to the host once per block
  (end tokens, stop strings, streaming, and one all-reduce carrying the interrupt flag).

Graphs live in the model's :attr:`MegatronModel.decoder` (:class:`GraphDecoder`): kept across calls,
captured again when the model's parameters moved (a LoRA adapter added, training re-bucketing), dropped
with the model (``del model``) or when a layout change releases it.  MoE layers (host-side token
counts in Megatron's dispatchers) and Megatron-FSDP models run the same step eagerly (:class:`Eager`),
as do CPU ranks when :data:`cpu_standin` is set (tests of this path's bookkeeping and arithmetic).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mnb.megatron import decode_kernels

log = logging.getLogger(__name__)

LENGTH_STEP = 256
"""Cache positions are allocated in multiples of this (a length bucket)."""
PROMPT_STEP = 64
"""Prompts are right-padded to a multiple of this (a prefill bucket)."""
PREFILL_GRAPH_TOKENS = 8192
"""rows x prompt positions up to which prefill is a graph too (above it its activations would stay
in the graph's memory pool; such a prefill runs the same code eagerly)."""
SYNC_EVERY = 16
"""Tokens decoded between host synchronisations (streaming, ends, stop strings, interrupts)."""
MAX_ENTRIES = 4
"""Buckets kept per model (least recently used dropped first)."""
compile_attention = False
"""True: on CUDA ranks the decode attention (cache write, scores, softmax, values) goes through
``torch.compile`` (fewer kernels per layer). Off by default: its one GPU run (2026-12-03) failed to
capture (the retry then met the pool the failed capture left recording; retries now take a fresh pool)."""
sdpa_decode = False
"""True: the decode attention is one ``scaled_dot_product_attention`` (memory-efficient kernel) over the
whole cache with an additive mask in the model's dtype, instead of five kernels (scores, mask, softmax,
cast, values); its arithmetic differs from the per-token path's (another summation order and rounding),
so it is off by default."""
compile_step = False
"""True: every call decodes as ``mnb.generate(..., compile=True)`` does (bench/gpu_generate.py's
``--variants compile_step``)."""
compile_backend = "inductor"
"""``torch.compile``'s backend for ``compile=True`` (tests: "eager", Dynamo's tracing without Inductor)."""
cpu_standin = False
"""Tests only: run this path on CPU ranks, the graph replaced by :class:`Eager` (no CUDA capture)."""
enabled = True
"""False: GPU ranks too take the per-token path (:func:`mnb.megatron.generate.decode`), for comparisons."""
own_kernels = True
"""True: where Triton runs (CUDA ranks; CPU ranks under ``TRITON_INTERPRET=1``, for tests) the decode
attention, RMSNorms and one-row linears of uncompiled decode steps (captured or not) and of the prefill are
:mod:`mnb.megatron.decode_kernels`' kernels (the attention one kernel instead of eight a layer); False:
torch's ops and cuBLAS, as before (comparisons)."""


def batch_bucket(batch: int) -> int:
    """Rows of the cache and graph for ``batch`` prompts: the next power of two."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return 1 << (batch - 1).bit_length()


def length_bucket(positions: int) -> int:
    """Cache positions for a call needing ``positions``: the next multiple of LENGTH_STEP."""
    return -(-positions // LENGTH_STEP) * LENGTH_STEP


def prompt_bucket(longest: int, limit: int) -> int:
    """Positions of the prefill for prompts of at most ``longest`` tokens: the next multiple of
    PROMPT_STEP, but not past the model's ``limit`` (max_position_embeddings)."""
    return min(-(-longest // PROMPT_STEP) * PROMPT_STEP, max(limit, longest))


class Eager:
    """The stand-in of a captured graph: ``replay()`` runs the step's Python again."""

    captured = False

    def __init__(self, step: Callable[[], Any]):
        self.step, self.output = step, None

    def replay(self) -> None:
        self.output = self.step()


class Graph:
    """``step`` captured as one CUDA graph (after two warm-up runs on a side stream).

    ``capture_error_mode="thread_local"``: a rank's other threads may use the GPU meanwhile (the
    ``mnb-fused-kernels`` thread compiles and runs the presets' kernels for minutes after a pool starts);
    in torch's default mode ("global") their calls that are unsafe during a capture (allocations,
    synchronisations) break it. On an H200 (2026-12-04, global mode) one capture of a fresh pool's second
    bucket failed while that thread was likely still at work (its error was not kept then;
    :attr:`GraphDecoder.capture_notes` keeps it now), and the step fell back to torch's ops.  A capture
    that fails leaves the thread on the stream it was on (torch's ``graph`` exits its stream context only
    after a capture that ended well)."""

    captured = True

    def __init__(self, step: Callable[[], Any]):
        before = torch.cuda.current_stream()
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(before)
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step()
            before.wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=torch.cuda.graph_pool_handle(),  # its own pool
                                  capture_error_mode="thread_local"):
                self.output = step()
        except BaseException:
            torch.cuda.set_stream(before)
            raise

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class Pass:
    """What the swapped core attentions read during one forward: mode, positions, mask, caches."""

    prefill: bool = False
    bias: torch.Tensor | None = None  # decode: [B, 1, 1, S], 0 where row b sees key j, else -inf (fp32;
    # with sdpa the model's dtype, which the memory-efficient kernel takes as it is)
    sdpa: bool = False  # decode attention through scaled_dot_product_attention (:data:`sdpa_decode`)
    positions: torch.Tensor | None = None  # decode: [B, 1] long
    attend: Callable | None = None  # decode_attention, compiled or not
    caches: dict = field(default_factory=dict)  # id(layer attention) -> (keys, values)
    rotation: torch.Tensor | None = None  # RoPE applied here (``[s, b, 1, 2, 2, rot/2]``), or None: by Megatron
    kernels: bool = False  # this step's attention, RMSNorms and one-row linears through decode_kernels


def rotation_table(angles: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The factors of Megatron's non-interleaved RoPE per position: ``[positions, 2, 2, rot/2]`` in
    ``dtype`` from its angles ``[positions, rot]``; ``[p, i, j]`` multiplies input half ``j`` for output
    half ``i``. Megatron computes ``x * cos + cat(-x2, x1) * sin`` (``_apply_rotary_pos_emb_bshd``,
    mscale 1): first half ``x1 * cos + (-x2) * sin``, second ``x2 * cos + x1 * sin``; ``(-x2) * sin``
    equals ``x2 * (-sin)`` bit for bit, so the table holds ``-sin`` there."""
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    half = angles.shape[-1] // 2
    first = torch.stack((cos[:, :half], -sin[:, :half]), dim=1)
    second = torch.stack((sin[:, half:], cos[:, half:]), dim=1)
    return torch.stack((first, second), dim=1)


def rotate(t: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``t [s, b, n, dim]`` rotated as Megatron does (each product and sum rounded as its unfused
    RoPE rounds them) in two kernels: the four products of each position at once, then their
    pairwise sums; ``factors [s, b, 1, 2, 2, rot/2]``: rows of :func:`rotation_table`. The query
    and key of a layer go through together (one tensor), so a layer's RoPE is three kernels with
    their concatenation, where Megatron's unfused one is ten."""
    half = factors.shape[-1]
    rot = 2 * half
    products = t[..., :rot].unflatten(-1, (1, 2, half)) * factors  # [s, b, n, 2, 2, half]
    out = torch.empty_like(t)
    torch.add(products[..., 0, :], products[..., 1, :], out=out[..., :rot].unflatten(-1, (2, half)))
    if rot < t.shape[-1]:
        out[..., rot:].copy_(t[..., rot:])
    return out


class CachedAttention(torch.nn.Module):
    """A layer's core attention over the static cache (Megatron shapes: ``[s, b, heads, dim]``)."""

    def __init__(self, original: torch.nn.Module, state: Pass, key: int, head_dim: int):
        super().__init__()
        self.state, self.key = state, key
        scale = getattr(original, "softmax_scale", None)
        self.scale = scale if scale else 1.0 / math.sqrt(head_dim)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        keys, values = self.state.caches[self.key]
        s, b, heads, dim = query.shape
        if self.state.rotation is not None:  # query and key rotated as one tensor
            both = rotate(torch.cat((query, key), dim=2), self.state.rotation)
            query, key = both[:, :, :heads], both[:, :, heads:]
        groups = key.shape[2]
        if self.state.prefill:  # positions 0..s-1 for every row (right-padded prompts)
            keys[:, :, :s].copy_(key.permute(1, 2, 0, 3))
            values[:, :, :s].copy_(value.permute(1, 2, 0, 3))
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            if groups != heads:
                k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return out.permute(2, 0, 1, 3).reshape(s, b, heads * dim)
        attend = (decode_kernels.decode_attention if self.state.kernels and not self.state.sdpa
                  else self.state.attend)
        return attend(query, key, value, keys, values, self.state.positions, self.state.bias, self.scale,
                      self.state.sdpa)


def decode_attention(query, key, value, keys, values, where, bias, scale: float, sdpa: bool = False):
    """One new position per row (``query [1, b, heads, dim]``, ``key/value [1, b, groups, dim]``,
    already rotated): written into the cache at ``where [b, 1]``, attended over the whole cache with
    the additive ``bias`` (two batched matmuls, fp32 scores and softmax); ``sdpa``: one
    ``scaled_dot_product_attention`` with ``bias`` as its additive mask."""
    _, b, heads, dim = query.shape
    groups = key.shape[2]
    index = where.view(b, 1, 1, 1).expand(b, groups, 1, dim)
    keys.scatter_(2, index, key.permute(1, 2, 0, 3))
    values.scatter_(2, index, value.permute(1, 2, 0, 3))
    q = query.permute(1, 2, 0, 3).reshape(b, groups, heads // groups, dim)  # a group's queries as rows
    if sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):  # plans fixed per shape
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale)
    else:
        scores = torch.add(bias, torch.matmul(q, keys.transpose(-1, -2)), alpha=scale)  # [b, g, rep, S] fp32
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)
    return out.reshape(b, heads, 1, dim).permute(2, 0, 1, 3).reshape(1, b, heads * dim)


_compiled_attention = None


def compiled_attention():
    """:func:`decode_attention` through ``torch.compile`` (made once per process)."""
    global _compiled_attention
    if _compiled_attention is None:
        _compiled_attention = torch.compile(decode_attention, dynamic=False)
    return _compiled_attention


def attentions(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention module of every layer of ``chunk``."""
    return [layer.self_attention for layer in chunk.decoder.layers]


@contextlib.contextmanager
def swapped_attention(chunks, state: Pass):
    """Every layer's core attention replaced by :class:`CachedAttention`; RoPE fusion off; restored after."""
    originals = []
    config = chunks[0].config
    rope_fusion = getattr(config, "apply_rope_fusion", False)
    try:
        config.apply_rope_fusion = False  # per-row positions: Megatron's unfused RoPE broadcasts them
        for chunk in chunks:
            for attention in attentions(chunk):
                original = attention.core_attention
                originals.append((attention, original))
                attention.core_attention = CachedAttention(original, state, id(attention),
                                                           attention.hidden_size_per_attention_head)
        yield
    finally:
        for attention, original in originals:
            attention.core_attention = original
        config.apply_rope_fusion = rope_fusion


@contextlib.contextmanager
def swapped_kernels(chunks, state: Pass):
    """While ``state.kernels`` (read when the step runs or is captured), every RMSNorm of ``chunks`` through
    :func:`decode_kernels.rms_norm`, every parallel linear given one row through :func:`decode_kernels.linear`
    and each fused MLP's SwiGLU through mnb's Triton kernel; otherwise torch's norm (``torch_forward``, also in a
    model built with mnb's norm kernels), Inductor's SwiGLU and the linears' own code (FP8 linears keep theirs):
    a step without mnb's kernels runs none of them.  Restored after."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from mnb.megatron.spec import LocalNorm, _fused_mlp_class

    modules = [m for chunk in chunks for m in chunk.modules()]
    norms = [m for m in modules if isinstance(m, LocalNorm) and m.rms]
    linears = [m for m in modules if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
               and "_forward_impl" not in vars(m)]
    mlps = [m for m in modules if isinstance(m, _fused_mlp_class())]
    try:
        for norm in norms:
            norm.forward = functools.partial(_norm_forward, norm, state)
        for linear in linears:
            linear._forward_impl = functools.partial(_linear_forward, linear, state)
        for mlp in mlps:
            mlp.forward = functools.partial(_mlp_forward, mlp, state)
        yield
    finally:
        for norm in norms:
            norm.__dict__.pop("forward", None)
        for linear in linears:
            linear.__dict__.pop("_forward_impl", None)
        for mlp in mlps:
            mlp.__dict__.pop("forward", None)
            mlp.__dict__.pop("own_kernels", None)


def _norm_forward(norm, state: Pass, x: torch.Tensor) -> torch.Tensor:
    if state.kernels:
        return decode_kernels.rms_norm(x, norm.weight, norm.eps)
    return norm.torch_forward(x)


def _mlp_forward(mlp, state: Pass, *args, **kwargs):
    """A fused MLP's forward whose SwiGLU is mnb's Triton kernel only while ``state.kernels`` (read when the
    step runs or is captured), Inductor's otherwise."""
    mlp.own_kernels = state.kernels
    return type(mlp).forward(mlp, *args, **kwargs)


def _linear_forward(linear, state: Pass, *args, **kwargs):
    """What Megatron's parallel linears call as ``self._forward_impl(input=, weight=, bias=, ...)``."""
    given = dict(zip(("input", "weight", "bias"), args), **kwargs)
    x, weight = given.get("input"), given.get("weight")
    if (state.kernels and not given.get("sequence_parallel") and given.get("gtp_remat_size", 1) in (None, 1)
            and decode_kernels.one_row(x, weight, given.get("bias"))):  # gtp > 1: Megatron gathers the weight
        return decode_kernels.linear(x, weight, given.get("bias"))
    return type(linear)._forward_impl(linear, *args, **kwargs)


def _as_it_is(inp, requires_grad, keep_graph):
    return inp


@contextlib.contextmanager
def views_kept():
    """Megatron's ``make_viewless_tensor`` as the identity in its layer and block modules, for a compiled
    decode step: it swaps ``.data`` of a new tensor (which ``torch.compile`` cannot trace) so that training
    can free a pipeline stage's output early; a decode step keeps nothing for a backward."""
    from megatron.core.transformer import transformer_block, transformer_layer

    saved = [(m, m.make_viewless_tensor) for m in (transformer_block, transformer_layer)]
    try:
        for module, _ in saved:
            module.make_viewless_tensor = _as_it_is
        yield
    finally:
        for module, original in saved:
            module.make_viewless_tensor = original


ARGMAX_BLOCKS = 512
"""At most this many blocks in :func:`first_argmax`'s first pass."""


@functools.lru_cache(maxsize=None)
def _argmax_blocks(vocab: int) -> int:
    """The most blocks, up to :data:`ARGMAX_BLOCKS`, that split ``vocab`` evenly (1: none does); per vocabulary
    once, not per token (uncaptured steps run this Python every token)."""
    return next((b for b in range(min(ARGMAX_BLOCKS, vocab // 2), 1, -1) if vocab % b == 0), 1)


def first_argmax(logits: torch.Tensor, out: torch.Tensor) -> None:
    """``torch.argmax(logits, -1)`` into ``out`` (the first index of the largest value, as argmax), in two
    passes: the largest of each block of the row, then the first block holding the row's largest.

    Why: one row of 128,256 logits is one reduction that CUDA's argmax runs in a single thread block
    (37 us of a 1.6 ms llama-1b decode step on an H200); blocks of a few hundred spread it over the GPU.
    ``max`` over a dimension and ``argmax`` both return the first index of a tie, so the result is
    argmax's, bit for bit.  A vocabulary without a divisor up to :data:`ARGMAX_BLOCKS` takes one pass.
    """
    vocab = logits.shape[-1]
    blocks = _argmax_blocks(vocab)
    if blocks == 1:
        torch.argmax(logits, dim=-1, out=out)
        return
    best, where = logits.unflatten(-1, (blocks, vocab // blocks)).max(dim=-1)  # [rows, blocks]
    block = best.argmax(dim=-1, keepdim=True)
    torch.add(where.gather(-1, block).squeeze(-1), block.squeeze(-1), alpha=vocab // blocks, out=out)


class Sampling:
    """Greedy or temperature / top-k / top-p choice of one token per row, on the device, graph-safe.

    Its tensors belong to a bucket (graphs read them); :meth:`configure` sets them for each call.
    """

    def __init__(self, vocab: int, rows: int, device: torch.device):
        self.greedy, self.vocab = True, vocab
        self.temperature = torch.ones((), dtype=torch.float64, device=device)
        self.top_k = torch.tensor(vocab, device=device)
        self.top_p = torch.tensor(2.0, dtype=torch.float64, device=device)
        self.ranks = torch.arange(vocab, device=device)
        self.draws = torch.zeros(rows, dtype=torch.float64, device=device)
        self.generator = torch.Generator(device=device)

    def configure(self, temperature: float, top_k: int, top_p: float, seed: int) -> None:
        self.greedy = temperature == 0
        self.temperature.fill_(temperature or 1.0)
        self.top_k.fill_(top_k or self.vocab)
        self.top_p.fill_(top_p if top_p < 1 else 2.0)  # 2: no nucleus cut, whatever the rounding
        self.generator.manual_seed(int(seed))

    def draw(self) -> None:
        """The next uniform numbers (outside the graph: one kernel per token)."""
        if not self.greedy:
            torch.rand(self.draws.shape, generator=self.generator, dtype=torch.float64,
                       device=self.draws.device, out=self.draws)

    def choose(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        logits = logits[:, : self.vocab]
        if self.greedy:  # in the logits' dtype: widening is exact, so the same index (first of ties)
            first_argmax(logits, out)
            return
        scaled = logits.double() / self.temperature
        order = torch.argsort(scaled, dim=-1, descending=True, stable=True)
        probs = torch.softmax(torch.gather(scaled, -1, order), dim=-1)
        probs = probs.masked_fill(self.ranks >= self.top_k, 0)
        probs = probs.masked_fill(torch.cumsum(probs, dim=-1) - probs >= self.top_p, 0)
        cdf = torch.cumsum(probs, dim=-1)
        picked = torch.searchsorted(cdf, (self.draws * cdf[:, -1]).unsqueeze(-1), right=True)
        out.copy_(torch.gather(order, -1, picked.clamp(max=self.vocab - 1)).squeeze(-1))


class Entry:
    """One bucket: caches, static inputs/outputs and the graphs of this rank's virtual stages."""

    def __init__(self, decoder: "GraphDecoder", rows: int, positions: int):
        self.rows, self.positions = rows, positions
        device, dtype = decoder.device, decoder.dtype
        self.caches = {}
        for chunk in decoder.chunks:
            for attention in attentions(chunk):
                shape = (rows, attention.num_query_groups_per_partition, positions,
                         attention.hidden_size_per_attention_head)
                self.caches[id(attention)] = (torch.zeros(shape, dtype=dtype, device=device),
                                              torch.zeros(shape, dtype=dtype, device=device))
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.chosen = self.tokens[:, 0]  # sampling writes the next inputs in place
        # each row's position and the tokens recorded so far: one tensor, so one kernel advances both
        self.counters = torch.zeros(rows + 1, dtype=torch.long, device=device)
        self.where = self.counters[:rows].view(rows, 1)
        self.count = self.counters[rows:]
        self.out = torch.zeros(rows, positions, dtype=torch.long, device=device)
        self.hidden_in = {v: torch.zeros(1, rows, decoder.hidden, dtype=dtype, device=device)
                          for v in decoder.stages}
        self.key_index = torch.arange(positions, device=device)
        self.rope = decoder.rope_table(positions)
        self.rotation = (None if self.rope is None or not decoder.own_rope
                         else rotation_table(self.rope, dtype))
        self.sampling = Sampling(decoder.vocab, rows, device)
        self.graphs: dict = {}  # (stage, greedy) -> Graph | Eager
        self.prefills: dict[int, Prefill] = {}  # prompt bucket -> its buffers and graphs

    def advance(self) -> None:
        """The chosen tokens (already the next inputs) recorded in ``out``; positions one on."""
        self.out.index_copy_(1, self.count, self.tokens)
        self.counters.add_(1)


class Prefill:
    """The static inputs of one prompt bucket: right-padded tokens, each row's last prompt position."""

    def __init__(self, decoder: "GraphDecoder", rows: int, length: int):
        device = decoder.device
        self.length = length
        self.tokens = torch.zeros(rows, length, dtype=torch.long, device=device)
        self.ends = torch.zeros(rows, dtype=torch.long, device=device)
        self.where = torch.arange(length, device=device).expand(rows, -1).contiguous()
        self.row_index = torch.arange(rows, device=device)
        self.hidden_in = {v: torch.zeros(length, rows, decoder.hidden, dtype=decoder.dtype, device=device)
                          for v in decoder.stages}
        self.graphs: dict = {}  # (stage, greedy) -> Graph | Eager


class GraphDecoder:
    """The decode graphs of one model on this rank (kept in ``MegatronModel.decoder``)."""

    def __init__(self, model, device: torch.device):
        from megatron.core import parallel_state as ps

        self.chunks = list(model.chunks)
        self.device = device
        self.dtype = next(self.chunks[0].parameters()).dtype
        self.hidden = model.config.hidden_size
        self.vocab = model.config.vocab_size
        self.pp = model.parallel.pp
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.next_rank = ps.get_pipeline_model_parallel_next_rank()
        self.prev_rank = ps.get_pipeline_model_parallel_prev_rank()
        self.n_stages = self.pp * len(self.chunks)
        self.stages = list(range(self.pp_rank, self.n_stages, self.pp))
        tconfig = model.transformer_config
        moe = bool(getattr(tconfig, "num_moe_experts", None))
        self.capture = device.type == "cuda" and not moe and model.parallel.fsdp is None
        self.why_eager = ("MoE layers (Megatron's token dispatch counts tokens on the host)" if moe else
                          "Megatron-FSDP gathers parameters per layer" if model.parallel.fsdp else "CPU rank")
        self.signature = self.params_signature(model)
        self.limit = model.config.max_position_embeddings
        # RoPE in CachedAttention (one cos/sin lookup per step) where it is Megatron's plain kind.
        self.own_rope = not (tconfig.rotary_interleaved or getattr(tconfig, "no_rope_freq", None)
                             or getattr(tconfig, "multi_latent_attention", False)
                             or any(getattr(a, "_yarn_concentration_factor", 1.0) not in (None, 1.0)
                                    for c in self.chunks for a in attentions(c)))
        self.entries: dict[tuple[int, int], Entry] = {}
        self.state = Pass()  # what the swapped attentions read; graphs captured it, so one per decoder
        self.captures = 0
        self.compiled_blocks: dict[int, Any] = {}
        """chunk index -> its layer stack through ``torch.compile`` (``generate(..., compile=True)``)."""
        self.compile_failed: BaseException | None = None
        """Why a compiled step did not capture: later steps of this decoder run the modules as they are."""
        self.capture_notes: list[str] = []
        """Each capture that failed and what was given up for it (also printed by rank 0)."""
        self.kernels = own_kernels and decode_kernels.runs_on(device)
        """Uncompiled steps' attention, RMSNorms and one-row linears through :mod:`decode_kernels` (False after a
        capture with them failed)."""

    @staticmethod
    def params_signature(model) -> tuple:
        """Where every parameter lives: graphs read these addresses, so a move means capture again."""
        return tuple(p.data_ptr() for chunk in model.chunks for p in chunk.parameters())

    def rope_table(self, positions: int) -> torch.Tensor | None:
        """RoPE angles ``[positions, dim]`` from the model's own rotary module (None without RoPE)."""
        rotary = getattr(self.chunks[0], "rotary_pos_emb", None)
        if getattr(self.chunks[0], "position_embedding_type", "rope") != "rope" or rotary is None:
            return None
        return rotary(positions).reshape(positions, -1).to(self.device)

    def entry(self, rows: int, positions: int) -> Entry:
        key = (rows, positions)
        entry = self.entries.pop(key, None)
        if entry is None:
            while len(self.entries) >= MAX_ENTRIES:
                self.entries.pop(next(iter(self.entries)))
            entry = Entry(self, rows, positions)
        self.entries[key] = entry  # most recently used last
        return entry

    # ---- one forward of a virtual stage -------------------------------------------------------
    def block(self, stage: int, compiled: bool):
        """The layer stack of ``stage``'s chunk, through ``torch.compile`` when ``compiled`` (and no compiled
        step of this decoder failed to capture): Inductor fuses each layer's norms, RoPE, attention
        arithmetic, SwiGLU and residual adds into a few kernels; the GEMMs stay cuBLAS's."""
        index = stage // self.pp
        chunk = self.chunks[index]
        if not compiled or self.compile_failed is not None:
            return chunk.decoder
        if index not in self.compiled_blocks:
            compiled_block = torch.compile(chunk.decoder, dynamic=False, backend=compile_backend)

            def run(**kwargs):
                with views_kept():
                    return compiled_block(**kwargs)

            self.compiled_blocks[index] = run
        return self.compiled_blocks[index]

    def stage_forward(self, stage: int, entry: Entry, state: Pass, tokens, where, hidden_in, compiled=False):
        """Stage ``stage``'s output: hidden states, or on the last stage the last positions' logits."""
        chunk = self.chunks[stage // self.pp]
        state.caches = entry.caches
        if stage == 0:
            hidden = chunk.embedding(input_ids=tokens, position_ids=where)
        else:
            chunk.set_input_tensor(hidden_in)
            hidden = None
        rope = state.rotation = None
        if entry.rotation is not None:  # one lookup per step: [s, b, 1, 2, 2, rot/2]
            state.rotation = entry.rotation[where].transpose(0, 1).unsqueeze(2)
        elif entry.rope is not None:
            rope = entry.rope[where].transpose(0, 1).unsqueeze(2)  # [s, b, 1, dim]: Megatron rotates
        hidden = self.block(stage, compiled)(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope)
        return hidden

    def logits(self, stage: int, hidden: torch.Tensor) -> torch.Tensor:
        chunk = self.chunks[stage // self.pp]
        weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights else None
        logits, _ = chunk.output_layer(hidden, weight=weight, runtime_gather_output=True)
        return logits[-1]

    def step(self, stage: int, entry: Entry, state: Pass, sampling: Sampling, compiled: bool = False):
        """The decode step of ``stage`` (what is captured); ``compiled``: its layers through ``torch.compile``."""
        state.prefill = False
        # a compiled step: Inductor fuses the norms itself; one whose compile did not capture runs as uncompiled
        state.kernels = self.kernels and not (compiled and self.compile_failed is None)
        state.positions = entry.where
        state.sdpa = sdpa_decode
        state.bias = None  # mnb's attention kernel masks by each row's position itself: no mask to build
        if not state.kernels or state.sdpa:
            state.bias = torch.where(entry.key_index <= entry.where, 0.0, float("-inf")).view(entry.rows, 1, 1, -1)
            if state.sdpa:
                state.bias = state.bias.to(self.dtype)
        hidden = self.stage_forward(stage, entry, state, entry.tokens, entry.where, entry.hidden_in[stage],
                                    compiled=compiled)
        if stage < self.n_stages - 1:
            return hidden
        sampling.choose(self.logits(stage, hidden), entry.chosen)
        if self.pp == 1:
            entry.advance()
        return None

    def prefill_step(self, stage: int, entry: Entry, prefill: Prefill, state: Pass, sampling: Sampling):
        """The prefill of ``stage`` for one prompt bucket (what is captured when small enough)."""
        state.prefill = True
        state.kernels = self.kernels
        hidden = self.stage_forward(stage, entry, state, prefill.tokens, prefill.where, prefill.hidden_in[stage])
        if stage < self.n_stages - 1:
            return hidden
        last = hidden[prefill.ends, prefill.row_index].unsqueeze(0)  # each row's last prompt position
        sampling.choose(self.logits(stage, last), entry.chosen)
        if self.pp == 1:
            entry.where.copy_(prefill.ends.unsqueeze(1))
            entry.count.zero_()
            entry.advance()
        return None

    def graph(self, graphs: dict, key, step: Callable[[], Any], entry: Entry, capture: bool,
              compiled: bool = False, what: str = "the decode step"):
        """``graphs[key]``, captured now if missing (``capture`` False: the step run as it is).

        A compiled step compiles in the capture's warm-up runs, before the capture."""
        if key not in graphs:
            entry.where.zero_()
            entry.count.zero_()
            if not capture:
                graphs[key] = Eager(step)
            else:
                graphs[key] = self._capture(step, compiled, what)
            self.captures += 1
        return graphs[key]

    def _capture(self, step: Callable[[], Any], compiled: bool = False, what: str = "the decode step"):
        """A :class:`Graph` of ``step``; if capture fails on any rank, once more as it is, then without what
        was compiled (the layers), without mnb's kernels, without the compiled attention (the step reads
        :attr:`compile_failed`, :attr:`kernels` and :attr:`Pass.attend` when it runs), and last the step run
        uncaptured (:class:`Eager`).

        Every rank takes the same branch: each attempt runs the step (tp collectives included) in its
        warm-ups, so a rank that tried again alone would pair its collectives with the others' next
        capture.  After each attempt the ranks agree (one all-reduce) whether every one of them captured.
        What was given up, with every error seen, goes to :attr:`capture_notes`; rank 0 prints it."""
        errors: list[str] = []

        def attempt():
            try:
                graph = Graph(step)
            except Exception as error:  # noqa: BLE001 - any capture failure: the call still runs
                graph = None
                errors.append(f"rank {torch.distributed.get_rank()}: {type(error).__name__}: {error}")
            return graph if self._every_rank(graph is not None) else None

        for tries in (1, 2):
            graph = attempt()
            if graph is not None:
                if tries == 2:
                    self._note(f"{what} captured at the second try; the first failed: {self._errors(errors)}")
                return graph
        dropped = []
        for name, applies, drop in (
                ("compiled layers", lambda: compiled and self.compile_failed is None,
                 lambda: setattr(self, "compile_failed", RuntimeError(errors[-1] if errors else "capture failed"))),
                ("mnb's Triton kernels", lambda: self.kernels, lambda: setattr(self, "kernels", False)),
                ("compiled attention", lambda: what == "the decode step" and self.state.attend is not decode_attention,
                 lambda: setattr(self.state, "attend", decode_attention))):
            if not applies():
                continue
            drop()
            dropped.append(name)
            graph = attempt()
            if graph is not None:
                self._note(f"{what} did not capture with {', '.join(dropped)} ({self._errors(errors)}); "
                           "captured it without")
                return graph
        self._note(f"CUDA graph capture of {what} failed ({self._errors(errors)}); decoding without graphs "
                   "(slower)")
        return Eager(step)

    def _every_rank(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (one all-reduce over the pool's world)."""
        flag = torch.tensor([int(ok)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    @staticmethod
    def _errors(errors: list[str]) -> str:
        """The errors seen, each once (ranks and attempts often fail alike), or where none was this rank's."""
        seen = list(dict.fromkeys(errors))
        return "; ".join(seen) if seen else "another rank's capture failed"

    def _note(self, text: str) -> None:
        """A capture's fallback, kept in :attr:`capture_notes`, logged, and printed by rank 0 (the cell shows it)."""
        self.capture_notes.append(text)
        log.warning("mnb.generate: %s", text)
        if torch.distributed.get_rank() == 0:
            print(f"mnb.generate: {text}", flush=True)

    # ---- the call -----------------------------------------------------------------------------
    def run(self, prompts: list[list[int]], max_new_tokens: int, sampling_args: dict, on_block,
            interrupted: Callable[[], bool], compile: bool = False) -> bool:
        """Decode; ``on_block(tokens [batch, n] on the host, last)`` after every block; True ends it.

        ``compile``: the decode step's layers through ``torch.compile`` before the capture (graphs kept
        apart from the uncompiled ones).  Returns whether an interrupt ended it.
        """
        # MoE and Megatron-FSDP steps run uncaptured (host-side counts, per-layer gathers): not compiled either
        compile = bool(compile or compile_step) and (self.capture or cpu_standin)
        batch = len(prompts)
        lengths = [len(p) for p in prompts]
        rows, positions = batch_bucket(batch), length_bucket(max(lengths) + max_new_tokens)
        entry = self.entry(rows, positions)
        sampling, state = entry.sampling, self.state
        sampling.configure(**sampling_args)
        length = prompt_bucket(max(lengths), self.limit)
        prefill = entry.prefills.get(length) or entry.prefills.setdefault(length, Prefill(self, rows, length))
        if state.attend is None:
            state.attend = compiled_attention() if self.capture and compile_attention else decode_attention
        # swapped whether or not mnb's kernels run: without them the norms are torch's (a model built with mnb's
        # norm kernels included), so a comparison or a capture that dropped the kernels runs torch's ops throughout
        with swapped_attention(self.chunks, state), swapped_kernels(self.chunks, state):
            before, start = self.captures, time.perf_counter()
            greedy = sampling.greedy
            graphs = {v: self.graph(entry.graphs, (v, greedy, compile),
                                    lambda v=v: self.step(v, entry, state, sampling, compile),
                                    entry, self.capture, compile) for v in self.stages}
            prefills = {v: self.graph(prefill.graphs, (v, greedy),
                                      lambda v=v: self.prefill_step(v, entry, prefill, state, sampling), entry,
                                      self.capture and rows * length <= PREFILL_GRAPH_TOKENS, what="the prefill")
                        for v in self.stages}
            if self.captures > before and self.capture:
                self._announce(rows, positions, length, time.perf_counter() - start,
                               compile and self.compile_failed is None)
            self.prefill(entry, prefill, prefills, sampling, prompts)
            done, steps = False, 1
            while not done:
                if steps < max_new_tokens:
                    sampling.draw()
                    self.decode_one(entry, graphs)
                    steps += 1
                if steps % SYNC_EVERY and steps < max_new_tokens:
                    continue
                stop = self._any_rank(interrupted())
                last = stop or steps >= max_new_tokens
                done = on_block(entry.out[:batch, :steps].cpu(), last) or last
                if stop:
                    return True
        return False

    def prefill(self, entry: Entry, prefill: Prefill, graphs: dict, sampling: Sampling, prompts) -> None:
        """All prompts in one causal pass, right-padded; each row's first token from its own last position."""
        tokens = torch.zeros(entry.rows, prefill.length, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p)
        ends = torch.tensor([len(p) - 1 for p in prompts] + [0] * (entry.rows - len(prompts)))
        prefill.tokens.copy_(tokens)
        prefill.ends.copy_(ends)
        sampling.draw()
        self.run_stages(graphs, prefill.hidden_in)
        if self.pp > 1:
            entry.where.copy_(prefill.ends.unsqueeze(1))
            entry.count.zero_()
            self.share(entry)

    def run_stages(self, graphs: dict, hidden_in: dict) -> None:
        """Each of this rank's stages in order: its input from the previous stage, replay, output on."""
        for stage in self.stages:
            if stage > 0:
                torch.distributed.recv(hidden_in[stage], src=self.prev_rank, group=self.pp_group)
            graphs[stage].replay()
            if stage < self.n_stages - 1:
                torch.distributed.send(graphs[stage].output.contiguous(), dst=self.next_rank, group=self.pp_group)

    def decode_one(self, entry: Entry, graphs: dict) -> None:
        self.run_stages(graphs, entry.hidden_in)
        if self.pp > 1:
            self.share(entry)

    def share(self, entry: Entry) -> None:
        """The last stage's tokens on every stage (pp > 1: one all-reduce), then the advance."""
        if self.pp > 1:
            if self.n_stages - 1 not in self.stages:
                entry.chosen.zero_()
            torch.distributed.all_reduce(entry.chosen, group=self.pp_group)
        entry.advance()

    def _any_rank(self, interrupted: bool) -> bool:
        flag = torch.tensor([int(interrupted)], device=self.device)
        torch.distributed.all_reduce(flag)
        return bool(flag.item())

    def _announce(self, rows: int, positions: int, length: int, seconds: float, compiled: bool) -> None:
        if torch.distributed.get_rank() == 0:
            how = "compiled and captured" if compiled else "captured"
            print(f"mnb.generate: {how} CUDA graphs for batch <= {rows}, prompts <= {length} tokens, "
                  f"{positions} positions in {seconds:.2f} s (kept for later calls of this size)", flush=True)


def decoder_of(model) -> GraphDecoder:
    """The model's :class:`GraphDecoder`, made (or made again, if its parameters moved) here."""
    from mnb.megatron.record import device_of

    current = model.decoder
    if current is None or current.signature != GraphDecoder.params_signature(model):
        model.decoder = None  # free the old graphs and caches first
        current = model.decoder = GraphDecoder(model, device_of())
    return current


def usable(model) -> bool:
    """Whether :func:`mnb.generate` takes this path: CUDA ranks (or :data:`cpu_standin`), RoPE or
    learned positions, Megatron's attention layers."""
    from mnb.megatron.record import device_of

    if not enabled or device_of().type != "cuda" and not cpu_standin:
        return False
    chunk = model.chunks[0]
    if getattr(chunk, "position_embedding_type", None) not in ("rope", "learned_absolute"):
        return False
    if getattr(model.transformer_config, "multi_latent_attention", False):
        return False
    return all(hasattr(a, "core_attention") and hasattr(a, "num_query_groups_per_partition")
               for c in model.chunks for a in attentions(c))
