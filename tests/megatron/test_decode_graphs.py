"""The decode step's attention pieces (mnb.megatron.decode_graphs) in one process, without ranks: the
RoPE bit for bit Megatron's, a layer's cached attention equal to causal attention over the whole
prefix, and the number of operations (each a kernel on a GPU) one decoded token costs a layer.

The whole path (buckets, layouts, sampling) runs on CPU ranks in tests/megatron/test_generate.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mnb.megatron import decode_graphs as dg

VIEWS = ("aten::view", "aten::_unsafe_view", "aten::permute", "aten::transpose", "aten::expand", "aten::slice",
         "aten::split", "aten::unsqueeze", "aten::select", "aten::as_strided", "aten::t", "aten::empty",
         "aten::detach", "aten::alias", "aten::unflatten", "aten::squeeze", "aten::chunk", "aten::lift_fresh",
         "aten::reshape")


class Operations(TorchDispatchMode):
    """The operations that run (views and allocations left out): on a GPU each is a kernel."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func._schema.name.startswith(VIEWS):
            self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def angles(positions: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (500000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(positions).float(), inv)
    return torch.cat((freqs, freqs), dim=-1)  # Megatron's non-interleaved layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [64, 32])
def test_rotate_is_megatrons_unfused_rope_bit_for_bit(dtype, rot):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    torch.manual_seed(0)
    table = angles(300, rot)
    where = torch.tensor([[7], [299], [0]])  # each row its own position
    q, k = torch.randn(1, 3, 8, 64).to(dtype), torch.randn(1, 3, 2, 64).to(dtype)
    freqs = table[where].transpose(0, 1).unsqueeze(2)  # [1, b, 1, rot], as Megatron is handed them
    factors = dg.rotation_table(table, dtype)[where].transpose(0, 1).unsqueeze(2)
    both = dg.rotate(torch.cat((q, k), dim=2), factors)
    assert torch.equal(both[:, :, :8], _apply_rotary_pos_emb_bshd(q, freqs))
    assert torch.equal(both[:, :, 8:], _apply_rotary_pos_emb_bshd(k, freqs))


class Core:
    softmax_scale = None


def reference(qs, ks, vs, table, n):
    """Causal attention of the n-th position over positions 0..n, RoPE as Megatron applies it."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    freqs = table[:n + 1].view(n + 1, 1, 1, -1)
    q, k = (_apply_rotary_pos_emb_bshd(t[:n + 1], freqs).permute(1, 2, 0, 3) for t in (qs, ks))
    out = F.scaled_dot_product_attention(q, k, vs[:n + 1].permute(1, 2, 0, 3), is_causal=True, enable_gqa=True)
    b, heads, _, dim = out.shape
    return out[:, :, -1:].permute(2, 0, 1, 3).reshape(1, b, heads * dim)


@pytest.mark.parametrize("sdpa", [False, True])
def test_a_decoded_token_attends_as_causal_attention_over_the_cache(sdpa):
    torch.manual_seed(1)
    b, heads, groups, dim, positions, prompt, steps = 2, 8, 2, 16, 256, 5, 4
    table = angles(positions, dim)
    state = dg.Pass(attend=dg.decode_attention)
    attention = dg.CachedAttention(Core(), state, key=0, head_dim=dim)
    state.caches = {0: (torch.zeros(b, groups, positions, dim), torch.zeros(b, groups, positions, dim))}
    qs, ks, vs = (torch.randn(prompt + steps, b, n, dim) for n in (heads, groups, groups))
    factors = dg.rotation_table(table, torch.float32)
    state.prefill, state.rotation = True, factors[:prompt].view(prompt, 1, 1, 2, 2, -1)
    attention(qs[:prompt], ks[:prompt], vs[:prompt])
    state.prefill, state.sdpa = False, sdpa
    for n in range(prompt, prompt + steps):
        where = torch.full((b, 1), n)
        state.positions, state.rotation = where, factors[where].transpose(0, 1).unsqueeze(2)
        state.bias = torch.where(torch.arange(positions) <= where, 0.0, float("-inf")).view(b, 1, 1, -1)
        out = attention(qs[n:n + 1], ks[n:n + 1], vs[n:n + 1])
        torch.testing.assert_close(out, reference(qs, ks, vs, table, n))


def test_a_layer_decodes_a_token_in_ten_operations():
    """RoPE of query and key together (concatenation, products, sums), the two cache writes, scores,
    mask, softmax, cast, values: 10 (the unfused RoPE of each tensor alone made it 17)."""
    b, heads, groups, dim, positions = 1, 32, 8, 64, 512
    state = dg.Pass(attend=dg.decode_attention)
    attention = dg.CachedAttention(Core(), state, key=0, head_dim=dim)
    dtype = torch.bfloat16
    state.caches = {0: (torch.zeros(b, groups, positions, dim, dtype=dtype),
                        torch.zeros(b, groups, positions, dim, dtype=dtype))}
    where = torch.full((b, 1), 100)
    state.positions = where
    state.rotation = dg.rotation_table(angles(positions, dim), dtype)[where].transpose(0, 1).unsqueeze(2)
    state.bias = torch.where(torch.arange(positions) <= where, 0.0, float("-inf")).view(b, 1, 1, -1)
    q, k, v = (torch.randn(1, b, n, dim).to(dtype) for n in (heads, groups, groups))
    with Operations() as ops:
        attention(q, k, v)
    assert len(ops.names) <= 10, ops.names


def test_greedy_choice_writes_the_next_inputs_and_one_add_advances():
    """The bf16 logits' argmax is the fp32 one's; it lands in the tokens the next step reads, and one
    add moves every row's position and the count of recorded tokens."""
    decoder = type("D", (), dict(chunks=[], device=torch.device("cpu"), dtype=torch.bfloat16, hidden=8,
                                 stages=[0], vocab=50, own_rope=False, rope_table=lambda self, p: None))()
    entry = dg.Entry(decoder, rows=4, positions=256)
    entry.where.copy_(torch.tensor([[3], [5], [7], [0]]))
    logits = torch.randn(4, 64).to(torch.bfloat16)  # a padded vocabulary: 64 columns, 50 tokens
    entry.sampling.choose(logits, entry.chosen)
    assert entry.tokens.view(-1).tolist() == logits[:, :50].float().argmax(-1).tolist()
    with Operations() as ops:
        entry.advance()
    assert len(ops.names) == 2, ops.names
    assert entry.where.view(-1).tolist() == [4, 6, 8, 1] and entry.count.tolist() == [1]
    assert entry.out[:, 0].tolist() == entry.tokens.view(-1).tolist()


@pytest.mark.parametrize("vocab", [128256, 50257, 320, 7])
def test_greedy_argmax_in_blocks_is_argmax_with_its_ties(vocab):
    """Two passes (the largest of each block, then the first block with the row's largest) pick the index
    ``torch.argmax`` picks, the first of equal values included; a prime vocabulary takes one pass."""
    generator = torch.Generator().manual_seed(vocab)
    tied = torch.randint(-3, 4, (3, vocab), generator=generator).to(torch.bfloat16)  # many equal values
    tied[1, vocab // 3] = tied[1, vocab - 1] = 100  # the row's largest twice, in different blocks
    padded = torch.randn(32, vocab + 5, generator=generator)[:, :vocab]  # a view, as the padded logits are
    for logits in (tied, padded):
        out = torch.empty(logits.shape[0], dtype=torch.long)
        with Operations() as ops:
            dg.first_argmax(logits, out)
        assert torch.equal(out, logits.argmax(-1))
        assert len(ops.names) == (1 if vocab == 7 else 4), ops.names  # max, argmax, gather, add
