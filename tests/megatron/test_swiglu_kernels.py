"""mnb's SwiGLU kernels (mnb.megatron.swiglu_kernels) on CPU, under Triton's interpreter.

In the launch test_decode_kernels.py and test_norm_kernels.py share (conftest's ``triton_interpreted``,
tests/megatron/scenarios.py, ``swiglu_kernels_interpreted``):

- forward and backward against the compiled kernel's arithmetic (``fusions._swiglu`` / ``_swiglu_grad`` in
  fp32): a width of one partial block, a width of a full block and a partial one, rows of a strided view, a
  3-D ``[s, b, 2f]`` input; fp32 and bf16;
- when they apply (not an odd width, integers, an empty input, switched off, a kernel that fails its probe),
  and ``fusions.swiglu`` routing to them by default while an explicit ``compiled=`` keeps its own path;
- tiny trained under tp2 + sequence parallelism with its MLPs fused (the class a GPU rank builds) and the
  SwiGLU in the kernels gives the losses and gradient norms of the same run with the eager fused SwiGLU, and
  the kernels ran for every layer of every micro batch, each way.

Leg 1's CPU torch has no Triton, so there this file is skipped; on GPUs the kernels run in every fused
model's training and decode (mnb.gpt's default on GPU ranks).  The interpreter rounds fp32 to bf16 by
truncation where a GPU rounds to nearest: bf16 results are compared within two bf16 steps of the largest
value.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.slow

BF16_STEPS = 2 * 2 ** -7


@pytest.fixture(scope="module")
def swiglu(triton_interpreted):
    return [rank["swiglu"] for rank in triton_interpreted]


def test_forward_and_backward_compute_what_the_compiled_kernel_computes(swiglu):
    kernels = swiglu[0]["kernels"]
    assert "error" not in kernels, kernels.get("error")
    cases = {name: case for name, case in kernels.items() if name.endswith(("float32", "bfloat16"))}
    assert len(cases) == 6
    for name, case in cases.items():
        dtype = name.rsplit("-", 1)[1]
        assert case["dtypes"] == [dtype] * 2 and case["shapes"] == [True, True], (name, case)
        assert case["calls"] == {"forward": 1, "backward": 1}, (name, case)
        bound = 1e-6 if dtype == "float32" else BF16_STEPS
        assert case["out"] <= bound and case["grad"] <= bound, (name, case)


def test_the_compiled_kernel_serves_where_these_do_not_apply(swiglu):
    kernels = swiglu[0]["kernels"]
    assert kernels["applies"] is True
    assert kernels["refuses"] == {name: False for name in (
        "odd width", "integers", "empty", "enabled = False", "probe fails")}
    assert kernels["routed"] == [1, 1]  # fusions.swiglu(x) ran the kernel; compiled=False its eager path


def test_training_under_tp2_sp_with_the_kernels_matches_the_eager_swiglu(swiglu):
    for rank in swiglu:
        eager, kernels = rank["tp2-sp-eager"], rank["tp2-sp-kernels"]
        assert "error" not in eager, eager.get("error")
        assert "error" not in kernels, kernels.get("error")
        assert eager["calls"] == {"forward": 0, "backward": 0}
        # tiny: 4 layers; 3 steps of 4 micro batches (global 4, micro batch 1)
        assert kernels["calls"] == {"forward": 4 * 4 * 3, "backward": 4 * 4 * 3}, kernels["calls"]
        assert kernels["losses"] == pytest.approx(eager["losses"], rel=1e-5)
        assert kernels["grad_norms"] == pytest.approx(eager["grad_norms"], rel=1e-4)
        assert kernels["losses"][2] < kernels["losses"][0]  # it trains
