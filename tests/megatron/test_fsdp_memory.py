"""Memory per component under each ZeRO level, counted on real CPU ranks, against mnb.estimate.memory.

The same tiny model on the same 2-rank pool under Megatron DDP, the distributed optimizer
and Megatron-FSDP's three levels (``--fsdp``); the ranks count their tensors
(mnb.megatron.memory.ComponentMeter: FSDP's weight and gradient buffers, the optimizer's
state, what autograd saves).  Within 5 % (FSDP pads its buffers to bucket multiples) for
every component, except ZeRO-3's weights and activations: what the ranks count there holds
every layer's parameters gathered (after mnb.train the model's parameters are full-shape
views of Megatron-FSDP's all-gather buckets), where the estimate holds two layers and those
outside the layers gathered; the gathered weights autograd saves count as activations.
"""

from __future__ import annotations

import pytest

import mnb
from mnb.config import ParallelConfig

pytestmark = pytest.mark.slow

LEVELS = (None, "distributed optimizer", "optim", "optim_grads", "optim_grads_params")
STATE = ("weights", "gradients", "optimizer")


def test_each_level_matches_the_estimate_per_component(cpu_pool):
    counted, predicted = {}, {}
    for level in LEVELS:
        extra = ", use_distributed_optimizer=True" if level == "distributed optimizer" else ""
        layout = ParallelConfig(fsdp=None if level in (None, "distributed optimizer") else level)
        cpu_pool.run("model = mnb.gpt('tiny')\n"
                     f"mnb.train(model, steps=2, micro_batch_size=2, global_batch_size=8{extra})",
                     layout=layout, quiet=True)
        run = mnb.last_run
        assert run.layout.fsdp == layout.fsdp
        assert sorted(run.measured_memory) == [0, 1]
        counted[level] = run.measured_memory
        predicted[level] = {r: run.predicted_components(r) for r in (0, 1)}
    for level in LEVELS:
        for rank in (0, 1):
            got, want = counted[level][rank], predicted[level][rank]
            names = STATE + ("activations",) if level != "optim_grads_params" else ("gradients", "optimizer")
            for name in names:
                assert got[name] == pytest.approx(want[name], rel=0.05), (level, rank, name, got, want)
    # what each level buys, measured: gradients halve from ZeRO-2 on, optimizer state from ZeRO-1 on
    ddp = counted[None][0]
    assert counted["optim_grads"][0]["gradients"] == pytest.approx(ddp["gradients"] / 2, rel=0.05)
    assert counted["optim"][0]["optimizer"] == pytest.approx(ddp["optimizer"] / 2, rel=0.05)
    assert counted["optim_grads_params"][0]["gradients"] == pytest.approx(ddp["gradients"] / 2, rel=0.05)
