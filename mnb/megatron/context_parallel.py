"""Context parallelism in mnb's SDPA core attention, for ranks without Transformer Engine.

Megatron-Core runs context parallelism (cp) only inside TE's attention; its own
``DotProductAttention`` asserts cp == 1.  When TE is absent, the local spec's
:class:`mnb.megatron.spec.SDPAttention` calls :func:`attention` here instead.

Layout (Megatron's, so batches, RoPE and the schedules' p2p shapes all agree):
the sequence is cut into ``2*cp`` equal chunks and cp rank ``i`` holds chunks
``i`` and ``2*cp-1-i``, one early and one late chunk, so every rank does the
same causal work.  Megatron's ``get_batch_on_this_cp_rank`` cuts the batches
(:func:`split_batch`), and its RoPE already rotates each token by its true
position on cp ranks (``get_pos_emb_on_this_cp_rank``).

Attention (the all-gather form of Llama 3, Grattafiori et al. 2024, sec. 3.3.2):
each rank all-gathers the keys and values of the whole sequence over the cp
group (small with GQA: ``2 * query_groups * head_dim`` per token), then
attends its two query chunks against the keys they may see: chunk ``g``
against the prefix of ``(g+1)`` chunks, with the causal diagonal aligned to the
lower right (``torch.nn.attention.bias.causal_lower_right``).  The backward
of the gather reduce-scatters dK/dV back to the ranks that own the tokens
(:class:`_GatherSequence`).  It is TE's ``cp_comm_type="all_gather"``; TE's
ring (``"p2p"``) and all-to-all variants are not implemented here.

The loss needs nothing extra: every cp rank sums the per-token loss of its own
tokens, and ``mnb.train`` all-reduces loss sums and token counts over all
ranks (``calculate_per_token_loss``).  Gradients of all other weights are
reduced by Megatron's DDP over its data-parallel x context-parallel group, and
``finalize_model_grads`` divides by the token count summed over that group,
so a cp=2 step equals the cp=1 step (tests/megatron/test_context_parallel.py).

Megatron-LM's own ``--context-parallel-size`` runs only with Transformer Engine
attention (``--transformer-impl transformer_engine``): a layout exported to
Megatron-LM with cp > 1 needs TE there; this module has no Megatron-LM equivalent.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F

SUPPORTED_COMM_TYPES = (None, "all_gather", "allgather")
"""``TransformerConfig.cp_comm_type`` values this module implements (None: its default)."""


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2*cp``) that cp rank ``cp_rank`` holds, in local order."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank must be in [0, {cp}), got {cp_rank}")
    return cp_rank, 2 * cp - 1 - cp_rank


def check_sequence(seq_length: int, cp: int) -> int:
    """The chunk length ``seq_length / (2*cp)``; ValueError naming the sizes if it is not whole."""
    if cp < 1 or seq_length % (2 * cp):
        raise ValueError(
            f"seq_length({seq_length}) is not divisible by 2 * cp({cp}) = {2 * cp}: context "
            f"parallelism cuts each sequence into 2*cp equal chunks; choose seq_length as a "
            f"multiple of {2 * cp} or another cp"
        )
    return seq_length // (2 * cp)


def split_batch(batch: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """This cp rank's chunks of a ``[b, s]`` batch, through Megatron's ``get_batch_on_this_cp_rank``.

    The signature differs by version: 0.16 takes ``(batch, cp_group=None)``;
    0.19 takes ``(batch, is_hybrid_cp, cp_group=None, ...)`` and, given no group,
    uses the *world* size instead of the cp size, so the group is always passed.
    """
    from megatron.core.utils import get_batch_on_this_cp_rank

    if group.size() == 1:
        return batch
    for key, value in batch.items():
        if value is not None:
            check_sequence(value.shape[1], group.size())
    if "is_hybrid_cp" in _parameters(get_batch_on_this_cp_rank):
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _gathered_to_sequence(cp: int) -> list[int]:
    """For each chunk of the sequence, its place among the gathered chunks (rank-major)."""
    return [2 * g if g < cp else 2 * (2 * cp - 1 - g) + 1 for g in range(2 * cp)]


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""torch 2.13 renamed the single-tensor collectives (the old names warn); 2.11 has only the old ones."""


def gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence ``[s, ...]`` from each cp rank's two chunks ``[s/cp, ...]`` (differentiable)."""
    return local if group.size() == 1 else _GatherSequence.apply(local, group)


class _GatherSequence(torch.autograd.Function):
    """All-gather the local ``[2c, ...]`` chunks over the cp group into sequence order ``[2c*cp, ...]``.

    Backward: the gradient of the whole sequence, put back in rank-major order and
    reduce-scattered, so each rank receives the sum over all cp ranks of the
    gradient of its own tokens (dK/dV of every query that saw them).
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        cp = group.size()
        ctx.group = group
        local = local.contiguous()
        gathered = local.new_empty((cp * local.shape[0], *local.shape[1:]))
        _all_gather(gathered, local, group=group)
        chunks = gathered.view(2 * cp, local.shape[0] // 2, *local.shape[1:])
        # torch.cat of views, not index_select: an index tensor would be a host-to-device copy per layer
        return torch.cat([chunks[slot] for slot in _gathered_to_sequence(cp)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        cp = group.size()
        order = _gathered_to_sequence(cp)
        inverse = [order.index(slot) for slot in range(2 * cp)]
        chunks = grad.view(2 * cp, grad.shape[0] // (2 * cp), *grad.shape[1:])
        rank_major = torch.cat([chunks[chunk] for chunk in inverse])
        local = grad.new_empty((grad.shape[0] // cp, *grad.shape[1:]))
        _reduce_scatter(local, rank_major, group=group)
        return local, None


def gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence (dim 0) from every cp rank's two chunks; identity when cp == 1."""
    if _size(group) == 1:
        return local
    return _GatherSequence.apply(local, group)


def _size(group) -> int:
    return 1 if group is None else group.size()


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, group,
              causal: bool = True, scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Core attention of this cp rank's two query chunks against the whole sequence's keys.

    Shapes are Megatron's: ``query [2c, b, heads, d]``, ``key``/``value``
    ``[2c, b, groups, d]`` (this rank's chunks ``i`` and ``2cp-1-i``, in that
    order; ``heads`` a multiple of ``groups``).  Returns ``[2c, b, heads, d]``.
    ``causal=False`` attends to every key.  Works for cp == 1 too (the gather is
    the identity; the two chunks are the two halves of the sequence); ``group=None``
    means cp == 1.
    """
    cp, rank = _size(group), (0 if group is None else group.rank())
    s_local, heads, groups = query.shape[0], query.shape[2], key.shape[2]
    if s_local % 2:
        raise ValueError(f"each cp rank holds two equal chunks; got a local sequence of {s_local}")
    if heads % groups:
        raise ValueError(f"attention heads({heads}) are not a multiple of query groups({groups})")
    c = s_local // 2
    if cp > 1:  # one collective for K and V together
        key, value = gather_sequence(torch.cat([key, value], dim=2), group).split([groups, groups], dim=2)
    # [s, b, n, d] -> [b, n, s, d], SDPA's layout
    k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
    q = query.permute(1, 2, 0, 3)
    gqa = heads != groups
    if not causal:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3)
    from torch.nn.attention.bias import causal_lower_right

    outs = []
    for slot, chunk in enumerate(chunk_ids(rank, cp)):
        q_chunk = q[:, :, slot * c:(slot + 1) * c]
        seen = (chunk + 1) * c  # keys of every chunk up to and including this one
        k_seen, v_seen = k[:, :, :seen], v[:, :, :seen]
        if seen == c:  # the first chunk: a square causal block, SDPA's own is_causal
            outs.append(F.scaled_dot_product_attention(
                q_chunk, k_seen, v_seen, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa))
        else:
            outs.append(F.scaled_dot_product_attention(
                q_chunk, k_seen, v_seen, attn_mask=causal_lower_right(c, seen), dropout_p=dropout_p,
                scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2).permute(2, 0, 1, 3)


def check_comm_type(cp_comm_type) -> None:
    """ValueError unless ``cp_comm_type`` is one this module implements (all-gather)."""
    kinds = cp_comm_type if isinstance(cp_comm_type, (list, tuple)) else [cp_comm_type]
    unsupported = sorted({str(k) for k in kinds if k not in SUPPORTED_COMM_TYPES})
    if unsupported:
        raise ValueError(
            f"cp_comm_type {unsupported} needs Transformer Engine attention; mnb's local spec "
            "all-gathers keys and values (cp_comm_type='all_gather' or None)"
        )


def cp_group(pg_collection=None):
    """The context-parallel group: the model's ``pg_collection.cp`` where given, else Megatron's."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()
