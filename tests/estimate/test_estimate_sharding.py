"""ZeRO levels (Megatron-FSDP's ``fsdp``) in the estimators, against values worked out by hand here."""

from __future__ import annotations

import pytest

import mnb.estimate as est
from mnb.config import ParallelConfig, TrainConfig, load_preset
from mnb.estimate import hardware
from mnb.units import GIB

# tiny (templates/presets/tiny.json): h 64, 4 heads of 16, 2 query groups, SwiGLU ffn 176, RMSNorm,
# vocabulary 512, untied output layer, 4 layers.
LAYER = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 64 + 3 * 64 * 176  # attention, 2 norms, SwiGLU MLP = 46208
OUTSIDE = 512 * 64 + 512 * 64 + 64  # embedding, output layer, final norm
P = 4 * LAYER + OUTSIDE  # 250432
LEVELS = (None, "optim", "optim_grads", "optim_grads_params")


def test_bytes_per_param_of_each_level():
    bf16, fp32 = TrainConfig(bf16=True), TrainConfig()
    # bf16: 2 B weights, 4 B fp32 gradients, 12 B fp32 master + Adam m, v; over 4 ranks
    assert est.bytes_per_param(bf16, 4) == {"weights": 2, "gradients": 4, "optimizer": 12}  # DDP: 18
    dist = est.bytes_per_param(TrainConfig(bf16=True, use_distributed_optimizer=True), 4)
    assert dist == {"weights": 2, "gradients": 4, "optimizer": 3}  # 6 + 12/4 = 9
    # Megatron-FSDP: the fp32 main weights (4/4) sit in its weight buffer, Adam's m, v (8/4) in the optimizer
    assert est.bytes_per_param(bf16, 4, fsdp="optim") == {"weights": 3, "gradients": 4, "optimizer": 2}
    assert est.bytes_per_param(bf16, 4, fsdp="optim_grads") == {"weights": 3, "gradients": 1, "optimizer": 2}
    assert est.bytes_per_param(bf16, 4, fsdp="optim_grads_params") == {"weights": 1.5, "gradients": 1,
                                                                       "optimizer": 2}  # 18 / 4
    # fp32: DDP 4 + 4 + 8 (Adam m, v); FSDP's main weights are a copy of their own: ZeRO-3 over 2: 20 / 2
    assert sum(est.bytes_per_param(fp32, 2, fsdp="optim_grads_params").values()) == 10


def test_memory_per_component_of_each_level():
    train = TrainConfig(global_batch_size=4)  # fp32, the CPU ranks' precision
    got = {level: est.memory("tiny", ParallelConfig(dp=2, fsdp=level), train).stages[0] for level in LEVELS}
    assert got[None].params == P
    expected = {  # (weights, gradients, optimizer) bytes on one of 2 ranks
        None: (4 * P, 4 * P, 8 * P),
        "optim": (4 * P + 2 * P, 4 * P, 4 * P),  # + the fp32 main weights' half
        "optim_grads": (4 * P + 2 * P, 2 * P, 4 * P),
        # ZeRO-3 holds, beside its shards, every layer of tiny and the parameters outside the layers gathered
        "optim_grads_params": (2 * P + 2 * P + 4 * (4 * LAYER + OUTSIDE), 2 * P, 4 * P),
    }
    for level, (w, g, o) in expected.items():
        s = got[level]
        assert (s.weights_bytes, s.gradients_bytes, s.optimizer_bytes) == (w, g, o), level
        assert s.activations_bytes == got[None].activations_bytes  # sharding leaves activations alone
    assert got["optim_grads_params"].gathered_weights_bytes == 4 * P
    assert got["optim_grads"].gathered_weights_bytes == 0
    # a group of one shards nothing and gathers nothing
    one = est.memory("tiny", ParallelConfig(dp=1, fsdp="optim_grads_params"), TrainConfig(global_batch_size=2))
    assert one.stages[0].weights_bytes == 8 * P and one.stages[0].gathered_weights_bytes == 0


def test_zero3_gathers_what_megatron_fsdp_prefetches():
    """Megatron-FSDP's prefetch budget is max(1e9, 2 * layer) // 2 elements: 2k + 1 layers gathered at the
    start of backward, k = ceil(budget / layer) (mnb.estimate.sharding.gathered_layers)."""
    from mnb.estimate.sharding import gathered_layers

    def held(preset, tp):
        return gathered_layers(load_preset(preset), ParallelConfig(dp=2, tp=tp, fsdp="optim_grads_params"))

    assert held("tiny", 1) == 4  # all of its 4 layers: 46,208 parameters each, far below the budget
    assert held("llama-8b", 1) == 7  # 218,112,000 a layer: k = 3
    assert held("llama-8b", 8) == 32  # 27,271,168 a layer on one of 8 tp ranks: every layer
    assert held("llama-70b", 1) == 3  # 855,654,400 a layer: the budget is the layer itself, k = 1
    assert gathered_layers(load_preset("tiny"), ParallelConfig(dp=2, fsdp="optim_grads")) == 0


def test_collective_volumes_of_each_level():
    train = TrainConfig(global_batch_size=8)  # fp32; 2 ranks, mbs 1 -> 4 microbatches
    t = {level: est.dp_traffic("tiny", ParallelConfig(dp=2, fsdp=level), train) for level in LEVELS}
    t["distributed optimizer"] = est.dp_traffic("tiny", ParallelConfig(dp=2),
                                                TrainConfig(global_batch_size=8, use_distributed_optimizer=True))
    m, g, w = 4, 4 * P, 4 * P
    assert t[None].num_microbatches == m and t[None].level == "ddp"
    assert t[None].as_dict() == {"all_reduce": g}
    assert t["distributed optimizer"].as_dict() == {"reduce_scatter": g, "all_gather": w}
    assert t["optim"].as_dict() == {"reduce_scatter": g, "all_gather": w}
    assert t["optim_grads"].as_dict() == {"reduce_scatter": m * g, "all_gather": w}  # reduced every microbatch
    # ZeRO-3: every layer before its forward and before its backward, what is outside the layers once
    layers_w, outside_w = 4 * 4 * LAYER, 4 * OUTSIDE
    assert t["optim_grads_params"].as_dict() == {"reduce_scatter": m * g,
                                                 "all_gather": 2 * m * layers_w + outside_w}
    assert t["optim_grads_params"].calls == {"reduce_scatter": m, "all_gather": 2 * m + 1}
    # a ring over 2 ranks sends half of a reduce-scatter / all-gather buffer, all of an all-reduce one
    assert t[None].sent_bytes() == g
    assert t["optim_grads_params"].sent_bytes("all_gather") == (2 * m * layers_w + outside_w) / 2
    assert t["optim_grads_params"].sent_bytes() == m * g / 2 + (2 * m * layers_w + outside_w) / 2
    with pytest.raises(ValueError, match="kind must be one of"):
        t[None].sent_bytes("broadcast")
    bf16 = est.dp_traffic("llama-8b", ParallelConfig(fsdp="optim_grads_params"),
                          TrainConfig(bf16=True, global_batch_size=16), gpus=8)
    llama_outside = est.stage_params(load_preset("llama-8b"), ParallelConfig(), 0).embedding
    # 2 microbatches, 2 gathers of every layer each, bf16
    assert bf16.all_gather_bytes == (2 * 2 * (bf16.params - llama_outside) + llama_outside) * 2
    alone = est.dp_traffic("tiny", ParallelConfig(dp=1, fsdp="optim_grads_params"), TrainConfig())
    assert alone.sent_bytes() == 0 and alone.as_dict() == {}


def test_step_time_adds_the_exposed_collectives():
    train = TrainConfig(bf16=True, global_batch_size=64)
    dev = hardware.device("h200")
    bw = dev.intra_node_bytes_per_s * dev.intra_efficiency
    times = {}
    for level in ("optim", "optim_grads", "optim_grads_params"):
        parallel = ParallelConfig(fsdp=level)
        s = est.step_time("llama-8b", parallel, train, gpus=8)
        traffic = est.dp_traffic("llama-8b", parallel, train, gpus=8)
        assert s.dp_comm_s == pytest.approx(traffic.sent_bytes() / bw)  # nothing overlapped by default
        times[level] = s
    # mnb's training adds weight gradients inside the GEMMs under DDP, not under Megatron-FSDP: like with like
    dist = est.step_time("llama-8b", ParallelConfig(), TrainConfig(bf16=True, global_batch_size=64,
                                                                  use_distributed_optimizer=True), gpus=8,
                         gradient_accumulation_fusion=False)
    assert times["optim"].total_s == pytest.approx(dist.total_s)
    assert times["optim"].dp_comm_s < times["optim_grads"].dp_comm_s < times["optim_grads_params"].dp_comm_s
    assert times["optim_grads_params"].optimizer_s == dist.optimizer_s  # the same shard is updated
    hidden = est.step_time("llama-8b", ParallelConfig(fsdp="optim_grads_params"), train, gpus=8,
                           overlap_grad_reduce=True, overlap_param_gather=True)
    assert hidden.dp_comm_s < times["optim_grads_params"].dp_comm_s


def test_plan_lists_fsdp_layouts_where_they_shard():
    rows = est.plan("llama-8b", gpus=8, gbs=64)
    levels = {r.parallel.fsdp for r in rows}
    assert levels == {None, "optim_grads", "optim_grads_params"}  # optim is the distributed optimizer's twin
    assert all((r.parallel.dp or 1) * r.parallel.cp > 1 for r in rows if r.parallel.fsdp)
    # Megatron-FSDP's device mesh is dp*cp x ep x tp over the whole world: no pipeline dimension
    assert any(r.parallel.pp > 1 for r in rows) and not any(r.parallel.pp > 1 for r in rows if r.parallel.fsdp)
    assert any(r.describe() == "tp1 pp1 dp8 fsdp:optim_grads_params" for r in rows)
    # where only sharding the parameters fits, the plan's best is ZeRO-3
    tight = est.plan("llama-8b", gpus=8, gbs=64, tps=[1], pps=[1], cps=[1], recomputes=("none",),
                     capacity_bytes=45 * GIB)
    assert tight.best is not None and tight.best.parallel.fsdp == "optim_grads_params"
    assert [r.fits for r in tight if r.parallel.fsdp != "optim_grads_params"] == [False, False]
    with pytest.raises(ValueError, match="not a sharding level"):
        est.plan("tiny", gpus=2, fsdps=("zero3",))


def test_parallel_config_fsdp_field():
    assert ParallelConfig().fsdp is None
    assert ParallelConfig(fsdp="optim_grads", dp=2).describe() == "tp1 pp1 dp2 fsdp:optim_grads"
    with pytest.raises(ValueError, match="optim_grads_params"):
        ParallelConfig(fsdp="zero3")
    with pytest.raises(ValueError, match=r"does not combine with pp\(2\)"):
        ParallelConfig(fsdp="optim", pp=2)
