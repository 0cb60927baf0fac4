"""A run's memory, measured beside predicted: per rank and component, against :func:`mnb.estimate.memory`.

Apart from :mod:`mnb.analysis.runs` (a run's records and the rest of their analysis),
whose :class:`~mnb.analysis.runs.Run`
exposes these as ``run.peak_memory_bytes``, ``run.measured_memory``, ``run.predicted_components(rank)``,
``run.predicted_memory``, ``run.memory_source``: how the ranks' memory
readings compare with the estimate is one concern.  Each function takes a ``Run`` (not imported here:
runs imports this module).  Pure Python.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mnb import estimate

MEASURED_COMPONENTS = ("weights", "gradients", "optimizer", "activations", "peak")
"""The components a rank counts (``memory_components`` of its record), in the order they are shown."""


def peak_memory_bytes(run: Any) -> dict[int, int]:
    """Measured peak bytes per rank: the CUDA allocator's, or on CPU the counted tensors'
    (weights + gradients + optimizer + activations in flight; see :func:`measured_memory`)."""
    out = {}
    for rank, rec in run.records_by_rank.items():
        peak = (rec.get("memory_components") or {}).get("peak")
        if peak is None:
            peak = (rec.get("memory") or {}).get("peak_allocated_bytes")
        if peak is None:
            peaks = [s.get("mem_peak_bytes") for s in rec.get("steps") or [] if s.get("mem_peak_bytes")]
            peak = max(peaks) if peaks else None
        if peak is not None:
            out[rank] = int(peak)
    return out


def measured_memory(run: Any) -> dict[int, dict[str, int]]:
    """What each rank held, by component, in bytes: ``{rank: {"weights", "gradients",
    "optimizer", "activations", "peak"}}``, counted from the tensors on the rank
    (activations: the most bytes saved for backward held at once); ``peak`` is the
    CUDA allocator's peak on GPUs, the counted total on CPU.  Ranks of older records
    without these counts are left out."""
    out = {}
    for rank, rec in run.records_by_rank.items():
        counted = rec.get("memory_components")
        if counted:
            out[rank] = {name: int(counted.get(name) or 0) for name in MEASURED_COMPONENTS}
    return out


def predicted_components(run: Any, rank: int) -> dict[str, float]:
    """The prediction for ``rank`` in the components of :func:`measured_memory`.

    ``activations`` is what is held between a microbatch's forward and its
    backward, as measured: the layers' saved tensors and what the loss saves
    (the fp32 softmax of Megatron's cross entropy, or the logits of mnb's fused
    one), not the layer that full recompute rematerialises during backward nor
    the bf16 logits the unfused loss drops; both count in ``peak``, the
    predicted total with workspace.
    """
    stage = run.predicted_memory.stages[stage_of_rank(run, rank)]
    element = 2 if (run.train.bf16 or run.train.fp8) else 4
    # saved: the fused loss's logits (half of logits_bytes: the other half is their gradient in
    # backward), or the unfused loss's fp32 softmax (the rest is a bf16 copy made in backward)
    saved_logits = stage.logits_bytes / 2 if run.fusions else stage.logits_bytes * 4 / (4 + (element % 4))
    return {
        "weights": stage.weights_bytes,
        "gradients": stage.gradients_bytes,
        "optimizer": stage.optimizer_bytes,
        "activations": stage.activations_bytes - stage.recomputed_bytes + saved_logits,
        "peak": stage.total_bytes,
    }


def memory_source(run: Any) -> str:
    """Where the measured peak comes from: 'cuda' (allocator), 'counted' (tensors), or 'rss' (old records)."""
    source = run.first_record.get("memory_source") or ("rss" if run.on_cpu else "cuda")
    if source == "rss" and run.first_record.get("memory_components"):
        return "counted"
    return source


def predicted_memory(run: Any) -> estimate.MemoryEstimate:
    """mnb.estimate.memory for this run's model, layout and train settings."""
    mem = estimate.memory(run.model, run.layout, run.train, num_microbatches=run.num_microbatches,
                          fused_loss=run.fusions, fused_kernels=run.fusions, cpu_kernels=run.on_cpu,
                          lora=run.first_record.get("lora"))
    if run.capacity_bytes:
        mem = replace(mem, capacity_bytes=run.capacity_bytes)
    return mem


def stage_of_rank(run: Any, rank: int) -> int:
    coords = run.records_by_rank[rank].get("coords") or {}
    if "pp" in coords:
        return int(coords["pp"])
    return run.predicted_memory.stage_of_rank(rank)
