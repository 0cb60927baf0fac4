"""mnb's RMSNorm kernels (mnb.megatron.norm_kernels) on CPU, under Triton's interpreter.

In the launch test_decode_kernels.py shares (conftest's ``triton_interpreted``, tests/megatron/scenarios.py,
``norm_kernels_interpreted``):

- forward and backward against ``F.rms_norm``'s autograd in fp32: rows of a strided view, a width that is
  not a power of two (forward tiles of several rows, the last short), a 3-D ``[s, b, h]`` input; the weight
  gradient summed over several programs' blocks, one of them partial, a row at a time and in tiles of rows
  (``BACKWARD_TILE``); a frozen weight;
- when they apply, and when torch's norm serves instead (no weight, too wide, integers, a weight of another
  width, an empty input, switched off, a kernel that fails its one probe); the probe under ``no_grad`` and
  inside non-reentrant checkpointing; the output its own tensor (written in place as torch's can be);
- a decode step without mnb's own kernels (``decode_graphs.own_kernels = False``) runs torch's norms and the
  fused MLP's SwiGLU without mnb's kernel; with them, both kernels run and the tokens are the same;
- tiny trained under tp2 + sequence parallelism with every RMSNorm through the kernels gives the losses and
  gradient norms of the same run with torch's norms (the norms' weight gradients are all-reduced over tp by
  Megatron, as for torch's), and the kernels ran for every norm of every micro batch, each way.

Leg 1's CPU torch has no Triton, so there this file is skipped; on GPUs the kernels run in
bench/train_kernels.py and in every fused model's training (mnb.gpt's default on GPU ranks).  The
interpreter rounds fp32 to bf16 by truncation where a GPU rounds to nearest: bf16 results are compared
within two bf16 steps of the largest value.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.slow

BF16_STEPS = 2 * 2 ** -7


@pytest.fixture(scope="module")
def norms(triton_interpreted):
    return [rank["norm"] for rank in triton_interpreted]


def test_forward_and_backward_compute_what_torch_computes(norms):
    kernels = norms[0]["kernels"]
    assert "error" not in kernels, kernels.get("error")
    cases = {name: case for name, case in kernels.items() if name.endswith(("float32", "bfloat16"))}
    assert len(cases) == 8
    for name, case in cases.items():
        dtype = name.rsplit("-", 1)[1]
        assert case["dtypes"] == [dtype] * 3 and case["shape"], (name, case)
        assert case["calls"] == {"forward": 1, "backward": 1}, (name, case)
        bound = 1e-6 if dtype == "float32" else BF16_STEPS
        for what in ("y", "dx", "dw"):
            assert case[what] <= bound, (name, what, case)
    assert kernels["frozen-weight"]["dx"] < 1e-5


def test_torchs_norm_serves_where_the_kernels_do_not_apply(norms):
    kernels = norms[0]["kernels"]
    assert kernels["applies"] is True
    assert kernels["refuses"] == {name: False for name in (
        "no weight", "wider than MAX_WIDTH", "integers", "weight of another width", "empty", "enabled = False",
        "probe fails")}
    assert kernels["applies_after_probe"] is True
    assert kernels["checkpointed"] is True  # the probe inside non-reentrant checkpointing
    assert kernels["written_in_place"] is True


def test_a_decode_without_mnbs_kernels_runs_none_of_them(norms):
    """decode_graphs.own_kernels off (the benchmarks' comparison; a capture that dropped the kernels): torch's
    norms and the fused MLP's SwiGLU without mnb's Triton kernel, though the model was built with both."""
    for rank in norms:
        run = rank["decode-own-kernels"]
        assert "error" not in run, run.get("error")
        off, on = run["off"], run["on"]
        assert off["kernels"] is False and on["kernels"] is True
        assert off["norm_calls"] == 0 and off["swiglu_calls"] == 0, off
        assert on["norm_calls"] > 0 and on["swiglu_calls"] > 0, on  # the same decode with them: they run
        assert on["tokens"] == off["tokens"] and len(off["tokens"][0]) == 4


def test_training_under_tp2_sp_with_the_kernels_matches_torchs_norms(norms):
    for rank in norms:
        torch_run, kernel_run = rank["tp2-sp-torch"], rank["tp2-sp-kernels"]
        assert "error" not in torch_run, torch_run.get("error")
        assert "error" not in kernel_run, kernel_run.get("error")
        assert torch_run["calls"] == {"forward": 0, "backward": 0}
        # tiny: 4 layers of 2 norms and the final norm; 3 steps of 4 micro batches (global 4, micro batch 1)
        assert kernel_run["calls"] == {"forward": 9 * 4 * 3, "backward": 9 * 4 * 3}, kernel_run["calls"]
        assert kernel_run["losses"] == pytest.approx(torch_run["losses"], rel=1e-5)
        assert kernel_run["grad_norms"] == pytest.approx(torch_run["grad_norms"], rel=1e-4)
        assert kernel_run["losses"][2] < kernel_run["losses"][0]  # it trains
