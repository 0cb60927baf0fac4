"""The text of :meth:`mnb.analysis.runs.Run.summary`: a training in a few lines, measured beside predicted.

Apart from :mod:`mnb.analysis.runs` (a run's records and their analysis), which calls it: how the numbers are
worded is one concern, what they are another.
"""

from __future__ import annotations

from typing import Any

from mnb.units import GIB, Text, format_bytes


def summary(run: Any) -> Text:
    """Loss, eval loss, tokens/s and MFU over the steady steps, unfused steps and kernel waits, the bubble
    (pipelines only) and peak memory against the prediction (a str that shows as text).

    ``run`` is a :class:`mnb.analysis.runs.Run`, not imported here: runs imports this module.
    """
    where = "CPU" if run.on_cpu else (run.device_name or run.first_record.get("device", "?"))
    lines = [f"{run.model.name} | {run.layout.describe()} | {run.world_size} ranks on {where} | "
             f"m={run.num_microbatches}"]
    losses = [x for x in run.losses if x is not None]
    if losses:
        lines.append(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(run.steps)} steps")
    evals = [(s, x) for s, x in zip(run.steps, run.eval_losses) if x is not None]
    if evals:
        lines.append(f"eval loss {evals[0][1]:.4f} (step {evals[0][0]}) -> {evals[-1][1]:.4f} "
                     f"(step {evals[-1][0]}), {len(evals)} evaluations")
    used = set(run.steady_steps(run.steps))  # after the first, less the profiled steps
    tps = [x for s, x in zip(run.steps, run.tokens_per_s) if s in used and x]
    mfus = [x for s, x in zip(run.steps, run.mfu) if s in used and x is not None]
    which = run.steps_note(sorted(used), "mean")
    perf = []
    if tps:
        perf.append(f"{sum(tps) / len(tps):,.0f} tokens/s ({which})")
    perf.append(f"MFU {sum(mfus) / len(mfus):.1%} vs {run.peak_source}" if mfus
                else "MFU n/a (no peak for this device)")
    lines.append(", ".join(perf))
    unfused = run.unfused_steps
    if unfused:
        first, last = unfused[0], unfused[-1]
        text = ((f"step {first}" if first == last else f"steps {first}\u2013{last}")
                + " unfused while compiling" + ("" if last < run.steps[-1] else " (the fused kernels were not ready yet)"))
        unfused_peak = run.step_peak_bytes(unfused)
        if unfused_peak is not None:
            fused_peak = run.step_peak_bytes([s for s in run.steps if s not in unfused])
            text += f", peak {format_bytes(unfused_peak)}" + (
                f" (fused steps {format_bytes(fused_peak)})" if fused_peak is not None else "")
        lines.append(text)
    for step, waited in run.kernel_waits.items():
        lines.append(f"step {step} waited {waited:.1f} s for the fused kernels (unfused it would not have fit)")
    if run.measured_bubble is not None and run.layout.pp > 1:  # no pipeline, no bubble to speak of
        text = (f"bubble measured {run.measured_bubble:.1%} ({run.measured_bubble_statistic}) "
                f"vs theoretical {run.theoretical_bubble:.1%}")
        expected = run.expected_bubble
        if expected is not None:
            text += f" ({expected:.1%} for the measured stage times)"
        lines.append(text)
    peaks = run.peak_memory_bytes
    if peaks and run.memory_source == "rss":
        # An old CPU record: only the process's resident set, which holds Python, torch
        # and Megatron too: nothing to compare the model's prediction with.
        rank = max(peaks, key=peaks.get)
        lines.append(f"peak resident memory {peaks[rank] / GIB:.2f} GiB (rank {rank}; "
                     "CPU ranks: process memory, not compared with the prediction)")
    elif peaks:
        rank = max(peaks, key=peaks.get)
        what = "allocator peak" if run.memory_source == "cuda" else "counted tensors"
        text = f"peak memory {format_bytes(peaks[rank])} (rank {rank}, {what})"
        try:
            predicted = run.predicted_components(rank)
            text += f" vs predicted {format_bytes(predicted['peak'])}"
            counted = run.measured_memory.get(rank)
            if counted:
                text += (f"; activations {format_bytes(counted['activations'])} vs "
                         f"{format_bytes(predicted['activations'])}")
        except ValueError as err:
            text += f"; no prediction: {err}"
        lines.append(text)
    return Text("\n".join(lines))
