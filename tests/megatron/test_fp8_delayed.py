"""fp8="delayed": the delayed-scaling cast kernel (mnb.megatron.fp8_delayed) under Triton's interpreter.

In the launch the other kernel files share (conftest's ``triton_interpreted``, tests/megatron/scenarios.py,
``fp8_delayed_interpreted``):

- twelve tensors in a row whose amaxes change call to call (each the format's max times 2**0..3), for
  histories of 1, 3 and 16 casts, both formats and the three pairs of layouts FP8Linear asks for: every
  scale is the format's max over the max of the history's amaxes (the first call's, its own), the data are
  the definition's bit for bit (values past the scale saturate), the transposed copy is laid out row by row,
  and the history the kernel leaves is the one torch's ops leave;
- FP8Linear inside a training step with its two histories: the forward, the input gradient and the weight
  gradient through the kernel equal those through torch's ops.

The inputs are FP8 values times powers of two, so no cast rounds: Triton's interpreter rounds FP8 unlike a
GPU (ties away from zero, a carry into the next power of two lost), and rounding is the GPU's
``cvt.rn.satfinite`` there.  Leg 1's CPU torch has no Triton, so there this file is skipped; the torch-ops
path is trained in test_fp8.py, and the kernel on a GPU in bench/gpu_fp8.py.
"""

from __future__ import annotations

import pytest
from conftest import ok

pytest.importorskip("triton")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def delayed(triton_interpreted):
    return triton_interpreted[0]["fp8_delayed"]


def test_the_kernel_scales_from_the_history_and_casts_as_defined(delayed):
    casts = ok(delayed["casts"])
    assert casts["cases"] == 3 * 2 * 3 * 12
    assert casts["wrong_scales"] == []
    assert len(set(casts["scales"])) == 4  # the scales did change with the history: 2**0 .. 2**-3
    assert casts["data_mismatch"] == 0 and casts["layout_mismatch"] == 0 and casts["torch_mismatch"] == 0
    assert casts["history_mismatch"] == 0 and casts["absent_ok"]
    assert casts["calls"] == {"kernel": casts["cases"], "torch": casts["cases"]}


def test_a_linear_in_a_step_gives_through_the_kernel_what_torch_ops_give(delayed):
    linear = ok(delayed["linear"])
    assert linear["kernel_calls"] == {"kernel": 6, "torch": 0}  # an input and a gradient a micro batch
    assert linear["torch_calls"] == {"kernel": 0, "torch": 6}
    assert linear["max_diff"] == 0.0
    e4m3_max, e5m2_max = 448.0, 57344.0
    # what the next cast would scale from: the largest amax seen (inputs 2**0, 2**1, 2**0; gradients 2**1, 2**0, 2**2)
    assert linear["amaxes"] == [2 * e4m3_max, 4 * e5m2_max] * 2
