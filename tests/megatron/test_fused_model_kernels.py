"""A fused model where every one of mnb's Triton kernels runs compiles nothing and trains as the unfused one.

On a GPU rank with Triton, ``mnb.gpt`` (``fusions="auto"``) builds a fused model whose norms, SwiGLUs, RoPE and
loss all run in mnb's own kernels (norm_kernels, swiglu_kernels, rope_kernels, loss_kernels): nothing is left
for the background compile, so no step runs unfused while compiling and no step waits.  Here the GPU is stood
in for by ``fusions.COMPILE_ON_CPU`` and Triton's interpreter, in the launch the kernel files share (conftest's
``triton_interpreted``, ``own_kernels_model_interpreted``): tiny built under tp2 + sequence parallelism, trained
3 steps, against the same model built unfused (Megatron's own ops); and what ``model.fused_shapes`` leaves to
compile when a kernel module is switched off.  Leg 1's CPU torch has no Triton, so there
this file is skipped; on a GPU, tests/test_gpu_smoke.py checks the same calls.
"""

from __future__ import annotations

import pytest
from conftest import ok

pytest.importorskip("triton")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(triton_interpreted):
    return [{name: ok(run) for name, run in rank["own_model"].items() if name != "left_to_compile"}
            for rank in triton_interpreted]


def test_what_is_left_to_compile_is_what_mnbs_kernels_do_not_run(triton_interpreted):
    left = ok(triton_interpreted[0]["own_model"]["left_to_compile"])
    assert left["served"] == []
    assert left["no device"] == ["rope_layouts", "swiglu_widths", "vocab_widths"]
    assert left["without RoPE"] == ["swiglu_widths", "vocab_widths"]
    assert (left["swiglu off"], left["rope off"], left["loss off"]) == (
        ["swiglu_widths"], ["rope_layouts"], ["vocab_widths"])


def test_a_fused_model_whose_kernels_all_run_compiles_nothing(trained):
    for rank in trained:
        own = rank["own-kernels"]
        assert own["fused"] is True and own["rope_fusion"] is True
        assert own["classes"] == ["FusedLocalNorm", "FusedLossGPTModel", "FusedSwiGLUMLP"], own["classes"]
        assert own["compiles"] is False
        assert own["compiling"] == [False] * 3  # no step ran unfused while compiling
        assert own["fused_op_calls"] == {"compiled": 0, "eager": 0}  # nothing went to Inductor or its eager stand-in


def test_every_fused_op_runs_in_mnbs_kernels_with_the_unfused_models_losses(trained):
    for rank in trained:
        own, unfused = rank["own-kernels"], rank["unfused"]
        assert unfused["fused"] is False and unfused["compiles"] is False
        assert all(count == 0 for count in unfused["calls"].values()), unfused["calls"]
        # tiny: 4 layers (2 norms each, and the final one), 3 steps of 4 micro batches (global 4, micro batch 1):
        # per micro batch 9 norms, 4 SwiGLUs, a query and a key rotated in each layer, one loss
        micro_batches = 3 * 4
        assert own["calls"] == {"norm": 9 * micro_batches, "swiglu": 4 * micro_batches,
                                "rope": 8 * micro_batches, "loss": micro_batches}, own["calls"]
        assert own["losses"] == pytest.approx(unfused["losses"], rel=1e-5)
        assert own["grad_norms"] == pytest.approx(unfused["grad_norms"], rel=1e-4)
        assert own["losses"][2] < own["losses"][0]  # it trains
