"""mnb's cross-entropy kernels (mnb.megatron.loss_kernels) on CPU, under Triton's interpreter.

In the launch the other kernel files share (conftest's ``triton_interpreted``, tests/megatron/scenarios.py,
``loss_kernels_interpreted``):

- the per-token loss and its gradient against the compiled loss's arithmetic (``fusions.
  vocab_parallel_cross_entropy`` run eagerly, fp32) and torch's ``cross_entropy``: a vocabulary of one
  partial block, one of two full blocks and a partial one (the online max and sum carried across blocks)
  ending in Megatron's padding columns at the dtype's lowest value (they get no gradient), strided rows;
  fp32 and bf16;
- a block of -inf logits (a user's mask) and targets outside the vocabulary, as the compiled loss counts them;
- a vocabulary split over a tp group of 2 (each rank's half of several blocks, padding at the end, targets on
  both; fp32 and bf16): each rank's loss is the whole vocabulary's, and its gradient that half of the whole
  gradient;
- when they apply, and ``vocab_parallel_cross_entropy`` routing to them by default while an explicit
  ``compiled=`` keeps its own path.

Whole models trained through them: test_fused_model_kernels.py.  Leg 1's CPU torch has no Triton, so there
this file is skipped.
"""

from __future__ import annotations

import pytest
from conftest import ok

pytest.importorskip("triton")

pytestmark = pytest.mark.slow

BF16_STEPS = 2 * 2 ** -7


@pytest.fixture(scope="module")
def loss(triton_interpreted):
    return [rank["loss"] for rank in triton_interpreted]


def test_loss_and_gradient_are_the_compiled_losss_and_torchs(loss):
    kernels = ok(loss[0]["kernels"])
    cases = {name: case for name, case in kernels.items() if name.endswith(("float32", "bfloat16"))}
    assert len(cases) == 6
    for name, case in cases.items():
        dtype = name.rsplit("-", 1)[1]
        assert case["dtypes"] == ["float32", dtype], (name, case)  # an fp32 loss, a gradient in the logits' dtype
        assert case["calls"] == {"forward": 1, "backward": 1}, (name, case)
        assert case["loss"] <= 1e-6 and case["torch"] <= 1e-5, (name, case)  # fp32 sums in another order
        assert case["grad"] <= (1e-6 if dtype == "float32" else BF16_STEPS), (name, case)
        assert case["padding_grad"] == 0.0, (name, case)


def test_a_masked_block_and_targets_outside_the_vocabulary_count_as_megatrons_loss_counts_them(loss):
    masked = ok(loss[0]["kernels"])["masked_and_outside"]
    assert masked["finite"] is True and masked["loss"] <= 1e-6, masked


def test_a_vocabulary_split_over_tp2_gives_the_whole_vocabularys_loss(loss):
    for rank in loss:
        split = ok(rank["tp2"])
        for dtype, case in split.items():
            assert case["targets_here"] > 0, case  # each rank holds some targets: both branches run
            assert case["loss"] <= 1e-6, (dtype, case)
            # 16,000 columns: the sum of exp in another order than torch's moves the softmax by a few fp32 steps
            assert case["grad"] <= (1e-5 if dtype == "float32" else BF16_STEPS), (dtype, case)


def test_the_compiled_loss_serves_where_these_do_not_apply(loss):
    kernels = ok(loss[0]["kernels"])
    assert kernels["applies"] is True
    assert kernels["refuses"] == {name: False for name in (
        "not [tokens, vocabulary]", "strided columns", "integers", "empty", "enabled = False", "probe fails")}
    # the kernels by default (one call); compiled=False the eager path (two fused ops: the max, then the sum of exp)
    assert kernels["routed"] == [1, 2]
