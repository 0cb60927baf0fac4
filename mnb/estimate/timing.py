"""A first-order step-time model: compute at an achievable fraction of peak, plus the
pipeline bubble, plus bandwidth-only communication terms.

    compute   = hardware FLOPs (causal attention, + recompute) / (gpus * peak * achievable_fraction)
    bubble    = compute * (pp-1)/(vpp*m)                  (Narayanan et al. 2021; bubble_time_ratio)
    tp        = layers/pp * m * (4, +2 with full recompute) all-reduces of s*b*h
    cp        = layers/pp * m * 3 ring passes of K and V
    ep        = MoE layers/pp * m * 4 all-to-alls of the routed tokens
    pp        = 2 * m point-to-point sends of s*b*h per rank
    dp        = gradient all-reduce (or reduce-scatter + all-gather with the
                distributed optimizer) of the stage's parameters, not overlapped

A ring collective over n ranks moves 2(n-1)/n of the buffer per rank for an
all-reduce and (n-1)/n for reduce-scatter / all-gather / all-to-all (Patarasuk
& Yuan 2009).  Groups that fit in a node use NVLink bandwidth, others the
per-GPU network bandwidth; ranks are ordered tp-cp-ep-dp-pp as Megatron does.
Latency, overlap and kernel efficiency beyond ``achievable_fraction`` are not
modelled: use it to rank layouts, not to promise a number.
"""

from __future__ import annotations

from dataclasses import dataclass

from mnb.config import ModelConfig, ParallelConfig, TrainConfig

from . import hardware
from ._inputs import as_model, as_parallel, as_train
from ._inputs import num_microbatches as resolve_microbatches
from .flops import flops, hardware_flops
from .memory import bytes_per_param
from .params import stage_params
from .pipeline import bubble_time_ratio


@dataclass(frozen=True, kw_only=True)
class StepTimeEstimate:
    """Predicted time of one training step, by part, in seconds."""

    compute_s: float
    bubble_s: float
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    model_flops: float
    """Model FLOPs per step (no recompute)."""
    tokens_per_step: int
    num_gpus: int
    peak_flops: float
    """Per-device peak used."""

    @property
    def total_s(self) -> float:
        return (
            self.compute_s + self.bubble_s + self.tp_comm_s + self.cp_comm_s
            + self.ep_comm_s + self.pp_comm_s + self.dp_comm_s
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.total_s * self.num_gpus * self.peak_flops)


def _bandwidth(dev: hardware.Device, stride: int, size: int, gpus_per_node: int) -> float:
    return dev.intra_node_bytes_per_s if stride * size <= gpus_per_node else dev.inter_node_bytes_per_s


def step_time(
    model: str | ModelConfig | dict,
    parallel: ParallelConfig | dict | None = None,
    train: TrainConfig | dict | None = None,
    *,
    gpus: int | None = None,
    gpu: str = "h200",
    peak_flops: float | None = None,
    achievable_fraction: float = 0.5,
    gpus_per_node: int = 8,
    num_microbatches: int | None = None,
    causal: bool = False,
) -> StepTimeEstimate:
    """Estimate the time of one step; see the module docstring for the model.

        mnb.estimate.step_time("llama-7b", ParallelConfig(), TrainConfig(
            bf16=True, global_batch_size=128), gpus=8, gpu="h200")
    """
    if not 0 < achievable_fraction <= 1:
        raise ValueError(f"achievable_fraction must be in (0, 1], got {achievable_fraction}")
    model = as_model(model)
    train = as_train(train)
    parallel = as_parallel(parallel, gpus)
    model.check_parallel(parallel)
    pp, tp, cp, ep, dp = parallel.pp, parallel.tp, parallel.cp, parallel.ep, parallel.dp or 1
    world = parallel.model_parallel_size * dp
    m = resolve_microbatches(train, parallel, num_microbatches)
    gbs = m * train.micro_batch_size * dp
    dev = hardware.device(gpu)
    dtype = hardware.train_dtype(train.bf16, train.fp8)
    peak = peak_flops or hardware.peak_flops(gpu, dtype)
    e = 2 if (train.bf16 or train.fp8) else 4

    model_f = flops(model, train, global_batch_size=gbs, causal=causal)
    # executed work: causal kernels skip the masked half whatever MFU's convention
    hw_f = hardware_flops(model, train, global_batch_size=gbs, causal=True)
    compute = hw_f / (world * peak * achievable_fraction)
    bubble_s = compute * bubble_time_ratio(parallel, m)

    s, b, h = model.seq_length // cp, train.micro_batch_size, model.hidden_size
    layers = max(model.layers_per_stage(pp))  # the busiest stage sets the pace
    act = s * b * h * e
    tp_s = cp_s = ep_s = pp_s = 0.0
    if tp > 1:
        per_layer = 4 + (2 if train.recompute == "full" else 0)
        nbytes = layers * m * per_layer * 2 * (tp - 1) / tp * act
        tp_s = nbytes / _bandwidth(dev, 1, tp, gpus_per_node)
    if cp > 1:
        kv = model.query_groups * model.head_dim
        nbytes = layers * m * 3 * (cp - 1) * s * b * 2 * kv * e / tp
        cp_s = nbytes / _bandwidth(dev, tp, cp, gpus_per_node)
    if ep > 1 and model.is_moe:
        nbytes = layers * m * 4 * (ep - 1) / ep * act * model.moe_router_topk / tp
        ep_s = nbytes / _bandwidth(dev, tp * cp, ep, gpus_per_node)
    if pp > 1:
        nbytes = 2 * m * act / (tp if parallel.sequence_parallel else 1)
        pp_s = nbytes / _bandwidth(dev, tp * cp * dp, pp, gpus_per_node)
    dp_s = 0.0
    if dp * cp > 1:
        params = max(stage_params(model, parallel, r).total for r in range(pp))
        bpp = bytes_per_param(train)
        n = dp * cp
        if train.use_distributed_optimizer:
            nbytes = (n - 1) / n * params * (bpp["gradients"] + bpp["weights"])
        else:
            nbytes = 2 * (n - 1) / n * params * bpp["gradients"]
        dp_s = nbytes / _bandwidth(dev, tp, dp * cp, gpus_per_node)
    return StepTimeEstimate(
        compute_s=compute,
        bubble_s=bubble_s,
        tp_comm_s=tp_s,
        cp_comm_s=cp_s,
        ep_comm_s=ep_s,
        pp_comm_s=pp_s,
        dp_comm_s=dp_s,
        model_flops=model_f,
        tokens_per_step=gbs * model.seq_length,
        num_gpus=world,
        peak_flops=peak,
    )
