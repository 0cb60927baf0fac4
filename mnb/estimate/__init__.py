"""Predicted memory, FLOPs/MFU, pipeline bubble and step time for Megatron layouts.

Pure Python (no torch, no numpy): usable in the notebook kernel and on ranks.
Every function returns plain numbers or frozen dataclasses with units in the
field names (``_bytes``, ``_flops``, ``_s``)::

    import mnb.estimate as est
    from mnb.config import ParallelConfig, TrainConfig
    train = TrainConfig(bf16=True, global_batch_size=128, use_distributed_optimizer=True)
    est.memory("llama-7b", ParallelConfig(), train, gpus=8, gpu="h200").summary()
    est.memory("/models/Llama-3.2-1B", ParallelConfig(tp=2), train, gpus=8)  # a Hugging Face folder's config.json
    est.flops("llama-7b", train)                      # model FLOPs per step
    est.bubble(ParallelConfig(pp=4, vpp=2, dp=1), 8)  # idle share of the step: (p-1)/(v*m+p-1) = 0.158
    est.mfu("llama-7b", train, step_time_s=6.0, num_gpus=8, gpu="h200")
    est.plan("llama-7b", gpus=8, gpu="h200", seq=4096, gbs=128)[0].describe()
    est.step_time("llama-7b", ParallelConfig(), train, gpus=8, gpu="h200").explain()  # where the time goes
    est.dp_traffic("llama-7b", ParallelConfig(fsdp="optim_grads_params"), train, gpus=8).as_dict()  # ZeRO-3's collectives

Sources are cited in each module: Korthikanti et al. 2022 (activations),
Megatron-LM theoretical_memory_usage.py and training.py (bytes per parameter,
FLOPs), Narayanan et al. 2021 (bubble, and Table 1, which the step-time model
reproduces: tests/estimate/test_estimate_scale.py); per-device calibration with
a source on every number in :mod:`mnb.estimate.calibration`.
"""

from __future__ import annotations

from . import hardware
from .flops import flops, flops_per_token, hardware_flops, mfu
from .hardware import DEVICES, Device, peak_flops
from .memory import COMPONENTS, MemoryEstimate, StageMemory, bytes_per_param, memory
from .params import StageParams, layer_params, stage_params
from .pipeline import bubble, bubble_time_ratio, in_flight, simulate_schedule, timeline_bubble, warmup_microbatches
from .plan import Plan, PlanRow, format_plan, plan
from .sharding import DataParallelTraffic, dp_traffic
from .explain import Explanation
from .timing import StepTimeEstimate, step_time

__all__ = [
    "COMPONENTS",
    "DEVICES",
    "DataParallelTraffic",
    "Device",
    "Explanation",
    "MemoryEstimate",
    "Plan",
    "PlanRow",
    "StageMemory",
    "StageParams",
    "StepTimeEstimate",
    "bubble",
    "bubble_time_ratio",
    "bytes_per_param",
    "dp_traffic",
    "flops",
    "flops_per_token",
    "format_plan",
    "hardware",
    "hardware_flops",
    "in_flight",
    "layer_params",
    "memory",
    "mfu",
    "peak_flops",
    "plan",
    "simulate_schedule",
    "stage_params",
    "step_time",
    "timeline_bubble",
    "warmup_microbatches",
]
