"""Context parallelism on the local spec (mnb.megatron.context_parallel), without Transformer Engine.

One 4-rank CPU pool serves the whole module:

- the attention function alone against single-rank SDPA of the whole sequence
  (fp64): outputs and the gradients of q, k and v, for cp 1, 2 and 4, several
  sequence lengths and GQA ratios, causal and not;
- Megatron's batch split is the chunk layout the attention assumes;
- training through the pool, as ``%%megatron --cp 2`` cells do (``mnb.gpt('tiny')``
  + ``mnb.train``): per-step loss and grad norm of cp2, cp2·tp2, cp2·pp2, cp2·tp2
  with sequence parallel, cp2·pp2·vpp2 and cp2 with selective recompute against
  cp=1 on the same ranks, fp32, 6 steps, rtol 1e-4.

Memory under cp (measured against mnb.estimate) is the cp2 case of test_memory.py.
"""

from __future__ import annotations

import pytest
import torch

from mnb.config import ParallelConfig
from mnb.megatron import context_parallel as cpm

pytestmark = pytest.mark.slow

# (cp, seq, batch, heads, query groups, causal): chunk lengths 1 to 6, GQA ratios 1, 2, 4.
ATTENTION_CASES = [
    (1, 8, 2, 4, 4, True),
    (1, 12, 1, 4, 1, True),
    (2, 8, 2, 4, 2, True),
    (2, 24, 1, 8, 2, True),
    (2, 16, 2, 4, 4, False),
    (4, 8, 1, 2, 2, True),
    (4, 48, 2, 4, 1, True),
    (4, 32, 1, 8, 4, False),
]


def attention_on_ranks() -> dict:
    """Every case on every rank (cp groups cut from 4 ranks); max abs differences to the reference."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = {}
    for cp in (2, 4):  # every rank creates every group, in the same order
        for first in range(0, world, cp):
            group = dist.new_group(list(range(first, first + cp)))
            if first <= rank < first + cp:
                groups[cp] = group
    results = {}
    for case in ATTENTION_CASES:
        cp, seq, b, heads, kv_heads, causal = case
        group = groups.get(cp)
        gen = torch.Generator().manual_seed(seq * 100 + heads * 10 + kv_heads)
        full = [torch.randn(seq, b, n, 8, generator=gen, dtype=torch.float64) for n in (heads, kv_heads, kv_heads)]
        grad_out = torch.randn(seq, b, heads, 8, generator=gen, dtype=torch.float64)
        # Reference: the whole sequence on one rank.
        ref_in = [t.clone().requires_grad_() for t in full]
        q, k, v = (t.permute(1, 2, 0, 3) for t in ref_in)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=heads != kv_heads).permute(2, 0, 1, 3)
        ref.backward(grad_out)
        # This rank's chunks, Megatron's layout.
        cp_rank = 0 if group is None else group.rank()
        c = seq // (2 * cp)
        index = torch.cat([torch.arange(i * c, (i + 1) * c) for i in cpm.chunk_ids(cp_rank, cp)])
        local = [t[index].clone().requires_grad_() for t in full]
        out = cpm.attention(*local, group=group, causal=causal)
        out.backward(grad_out[index])
        results[str(case)] = {
            "out": float((out - ref[index]).abs().max()),
            **{f"d{name}": float((t.grad - r.grad[index]).abs().max())
               for name, t, r in zip("qkv", local, ref_in)},
        }
    return results


def split_on_ranks() -> dict:
    """Megatron's batch split (through mnb's version-adaptive call) against chunk_ids, cp=2 and 4."""
    import torch.distributed as dist

    rank, out = dist.get_rank(), {}
    for cp in (2, 4):
        for first in range(0, dist.get_world_size(), cp):
            group = dist.new_group(list(range(first, first + cp)))
            if first <= rank < first + cp:
                mine = group
        positions = torch.arange(16).repeat(2, 1)
        batch = cpm.split_batch({"position_ids": positions.clone(), "tokens": positions + 100}, mine)
        c = 16 // (2 * cp)
        expected = torch.cat([torch.arange(i * c, (i + 1) * c) for i in cpm.chunk_ids(mine.rank(), cp)])
        out[cp] = bool(torch.equal(batch["position_ids"], expected.repeat(2, 1))
                       and torch.equal(batch["tokens"], expected.repeat(2, 1) + 100))
    return out


# name -> (ParallelConfig kwargs, extra mnb.train kwargs); each must reproduce cp=1 (dp=4) step by step
TRAIN_LAYOUTS = {
    "cp2": ({"cp": 2}, {}),
    "cp2-tp2": ({"cp": 2, "tp": 2}, {}),
    "cp2-pp2": ({"cp": 2, "pp": 2}, {}),
    "cp2-tp2-sp": ({"cp": 2, "tp": 2, "sequence_parallel": True}, {}),
    "cp2-pp2-vpp2": ({"cp": 2, "pp": 2, "vpp": 2}, {}),
    "cp2-selective-recompute": ({"cp": 2}, {"recompute": "selective"}),  # the gather runs again in backward
}
STEPS = 6


def _on_pool(pool, function: str) -> list:
    """Call one of this file's rank-side functions on every rank of the pool; results in rank order."""
    code = ("import importlib.util\n"
            f"_spec = importlib.util.spec_from_file_location('cp_test_bodies', {__file__!r})\n"
            "_bodies = importlib.util.module_from_spec(_spec)\n"
            "_spec.loader.exec_module(_bodies)\n"
            f"_bodies.{function}()")
    results = pool.run(code, quiet=True)
    return [results[rank] for rank in sorted(results)]


@pytest.fixture(scope="module")
def direct(pool4):
    return {"attention": _on_pool(pool4, "attention_on_ranks"), "split": _on_pool(pool4, "split_on_ranks")}


def _trained(pool, parallel: dict, extra: dict) -> torch.Tensor:
    """(loss, grad norm) per step of the tiny preset, as a ``%%megatron`` cell trains it (fp32, mock data)."""
    import mnb

    layout = ParallelConfig(**parallel)
    args = "".join(f", {k}={v!r}" for k, v in extra.items())
    pool.run(f"model = mnb.gpt('tiny')\nmnb.train(model, steps={STEPS}, micro_batch_size=1, "
             f"global_batch_size=4, lr=1e-3{args})", layout=layout, quiet=True)
    run = mnb.last_run
    assert (run.layout.cp, run.layout.tp, run.layout.pp) == (layout.cp, layout.tp, layout.pp)
    rows = [[row["loss"], row["grad_norm"]] for row in run.records[-1]["steps"]]  # the last rank holds the loss
    return torch.tensor(rows, dtype=torch.float64)


@pytest.fixture(scope="module")
def reference(pool4):
    """cp=1 on the same 4 ranks (dp=4)."""
    return _trained(pool4, {}, {})


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "cp{}-s{}-b{}-h{}-g{}-{}".format(
    *c[:5], "causal" if c[5] else "full"))
def test_attention_matches_single_rank_sdpa(direct, case):
    for rank, result in enumerate(direct["attention"]):
        diffs = result[str(case)]
        assert max(diffs.values()) < 1e-12, (rank, diffs)


def test_megatron_batch_split_is_the_attention_layout(direct):
    assert direct["split"] == [{2: True, 4: True}] * 4


def test_layout_errors_say_what_to_change():
    assert cpm.check_sequence(64, 2) == 16
    with pytest.raises(ValueError, match=r"seq_length\(60\) is not divisible by 2 \* cp\(4\) = 8"):
        cpm.check_sequence(60, 4)
    assert cpm.chunk_ids(1, 4) == (1, 6)
    cpm.check_comm_type(None)
    cpm.check_comm_type(["all_gather", None])
    with pytest.raises(ValueError, match=r"cp_comm_type \['p2p'\] needs Transformer Engine"):
        cpm.check_comm_type("p2p")


@pytest.mark.parametrize("name", list(TRAIN_LAYOUTS))
def test_cp_training_matches_cp1_step_by_step(pool4, reference, name):
    steps = _trained(pool4, *TRAIN_LAYOUTS[name])
    assert steps.shape == (STEPS, 2)
    torch.testing.assert_close(steps[:, 0], reference[:, 0], rtol=1e-4, atol=0, msg=f"loss of {name}")
    torch.testing.assert_close(steps[:, 1], reference[:, 1], rtol=1e-4, atol=0, msg=f"grad norm of {name}")
    assert reference[-1, 0] < reference[0, 0] - 0.2  # the reference trains: the comparison is not of noise
