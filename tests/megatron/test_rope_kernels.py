"""mnb's RoPE kernel (mnb.megatron.rope_kernels) on CPU, under Triton's interpreter.

In the launch test_decode_kernels.py, test_norm_kernels.py and the other kernel files share (conftest's
``triton_interpreted``, tests/megatron/scenarios.py, ``rope_kernels_interpreted``):

- forward and backward against the compiled kernel's arithmetic (``fusions._rope`` / ``_rope_grad`` in fp32):
  heads that are not a multiple of a program's block, a partial rotation (the other columns pass through), a
  strided view of heads; fp32 and bf16;
- Megatron's query and key (views of the fused QKV projection) through ``fusions.fused_rope``, Megatron's
  fused-RoPE slot, against Megatron's own unfused RoPE, output and the gradient into the QKV (also at micro
  batch 1 with one head per group, half of it rotated);
- when it applies, and ``fused_rope`` routing to it by default while an explicit ``compiled=`` keeps its own
  path.

Whole models trained through it: test_fused_model_kernels.py.  Leg 1's CPU torch has no Triton, so there this
file is skipped.  bf16 results are compared within two bf16 steps of the largest value (the interpreter
truncates where a GPU rounds to nearest).
"""

from __future__ import annotations

import pytest
from conftest import ok

pytest.importorskip("triton")

pytestmark = pytest.mark.slow

BF16_STEPS = 2 * 2 ** -7


@pytest.fixture(scope="module")
def kernels(triton_interpreted):
    return ok(triton_interpreted[0]["rope"]["kernels"])


def test_forward_and_backward_compute_what_the_compiled_kernel_computes(kernels):
    cases = {name: case for name, case in kernels.items() if name.endswith(("float32", "bfloat16"))}
    assert len(cases) == 6
    for name, case in cases.items():
        dtype = name.rsplit("-", 1)[1]
        assert case["dtypes"] == [dtype] * 2 and case["shape"] and case["contiguous"], (name, case)
        assert case["calls"] == {"forward": 1, "backward": 1}, (name, case)
        bound = 1e-6 if dtype == "float32" else BF16_STEPS
        assert case["out"] <= bound and case["grad"] <= bound, (name, case)


def test_megatrons_query_and_key_views_rotate_as_megatrons_unfused_rope(kernels):
    for name in ("megatron_views", "megatron_views_one_head"):  # the second: micro batch 1, one head, half rotated
        views = kernels[name]
        assert views["calls"] == {"forward": 2, "backward": 2}, (name, views)
        assert views["out"] <= 1e-6 and views["grad"] <= 1e-6, (name, views)


def test_the_compiled_kernel_serves_where_this_one_does_not_apply(kernels):
    assert kernels["applies"] is True
    assert kernels["refuses"] == {name: False for name in (
        "odd rotation", "rotation wider than the head", "a table row for every position", "integers", "empty",
        "enabled = False", "probe fails")}
    assert kernels["routed"] == [1, 1]  # fused_rope ran the kernel by default; compiled=False its eager path
