"""mnb's Triton kernels of the decode step (mnb.megatron.decode_kernels) on CPU, under Triton's interpreter.

One launch of 2 gloo ranks with ``TRITON_INTERPRET=1`` (tests/megatron/scenarios.py,
``decode_kernels_interpreted``, in the launch test_norm_kernels.py shares: conftest's ``triton_interpreted``):

- the attention of one new position against the eager decode attention: grouped queries, rows at
  different positions, the first and the last position of the cache, a cache of several key blocks,
  a head size not a power of two, query and key as strided views (as after the fused qkv and RoPE);
  the new key and value written where the eager path writes them;
- RMSNorm against ``F.rms_norm``, and a one-row linear against ``F.linear`` (with and without bias, a
  partial last block of rows, several column blocks of a weight whose rows are not contiguous with each
  other); a kernel that fails its one probe leaves torch's ops in charge;
- ``mnb.generate``'s decode step with these kernels (its graphs replaced by plain calls) gives the
  per-token path's greedy tokens under dp2, tp2, pp2 and tp2 with LoRA adapters on every linear, and the
  kernels did run; in bf16 at batch 1 every
  linear of a decode step goes through the one-row kernel.

Triton comes with torch's CUDA wheels (CI's leg 2 installs one and runs it on the CPU); leg 1's CPU
build has none, so there this file is skipped.  On GPUs the same kernels run in bench/gpu_generate.py.
The interpreter rounds fp32 to bf16 by truncation where a GPU rounds to nearest, so bf16 results are
compared within one bf16 step (2^-7 relative), fp32 results to fp32's rounding.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.slow

BF16_STEP = 2 ** -7


@pytest.fixture(scope="module")
def interpreted(triton_interpreted):
    return [rank["decode"] for rank in triton_interpreted]


def test_each_kernel_computes_what_torch_computes(interpreted):
    first = interpreted[0]
    assert first["runs_on_cpu"] is True
    kernels = first["kernels"]
    assert "error" not in kernels, kernels.get("error")
    attention = {k: v for k, v in kernels.items() if not k.startswith(("rms_norm", "linear", "one_row", "probe"))}
    assert len(attention) == 6
    for name, case in attention.items():
        assert case["cache_written"], name  # the new key and value at each row's position
        if name.endswith("float32"):
            assert case["error"] < 1e-5, (name, case)
        else:
            assert case["dtype"] == "torch.bfloat16" and case["relative"] <= BF16_STEP, (name, case)
        assert case["shape"][0] == 1
    assert kernels["rms_norm-float32"]["error"] < 1e-5
    assert kernels["rms_norm-bfloat16"]["dtype"] == "torch.bfloat16"
    assert kernels["rms_norm-bfloat16"]["relative"] <= BF16_STEP
    for rows in (37, 64, 24):
        linear = kernels[f"linear-{rows}"]
        assert linear["one_row"] and linear["shape"] == [1, 1, rows] and linear["dtype"] == "torch.bfloat16"
        assert linear["excess"] <= 1e-3, linear  # within one bf16 step of the exact product
    assert kernels["one_row-refuses"] == [False, False]  # two rows; fp32
    assert kernels["probe_refuses"] is False and kernels["probe_passes"] is True


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2", "tp2-lora"])
def test_the_decode_step_with_the_kernels_chooses_the_per_token_paths_tokens(interpreted, layout):
    for rank, result in enumerate(interpreted):
        run = result[layout]
        assert "error" not in run, run.get("error")
        assert run["kernels"] is True
        assert run["equal"] is True
        # tiny: 4 layers of one attention and 2 RMSNorms, and a final norm; prefill and 11 decode steps;
        # under pp2 each rank holds 2 of the layers, and the last stage the final norm
        layers, final = (2, rank) if layout == "pp2" else (4, 1)
        assert run["calls"]["attention"] == layers * 11, run["calls"]
        assert run["calls"]["rms_norm"] == (2 * layers + final) * 12, run["calls"]


def test_a_one_row_bf16_decode_runs_its_linears_through_the_kernel(interpreted):
    for rank in interpreted:
        run = rank["tp2-bf16-batch1"]
        assert "error" not in run, run.get("error")
        assert run["tokens"] == 6
        # 5 decode steps, each 4 layers of qkv, proj, fc1, fc2 and the output layer; and the prefill's output
        # layer (its last position); the prefill's layers see 64 rows (its bucket): not one row
        assert run["calls"]["linear"] == 5 * (4 * 4 + 1) + 1, run["calls"]
        assert run["calls"]["attention"] == 4 * 5 and run["calls"]["rms_norm"] == 9 * 6, run["calls"]
