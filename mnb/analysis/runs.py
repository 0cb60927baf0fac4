"""Run records on the notebook side: measured beside predicted.

``mnb.train`` produces one record (a JSON-able dict) per rank; the controller
gathers them and builds a :class:`Run`::

    run = Run(records)                 # or mnb.last_run
    run.losses, run.tokens_per_s, run.mfu
    run.peak_memory_bytes, run.predicted_memory.peak_bytes
    run.measured_bubble, run.theoretical_bubble
    run.summary(); run.plot_memory(); run.plot_timeline(); run.plot_mfu()
    Run.from_dict(json.loads(json.dumps(run.to_dict())))

Record schema (optional keys may be missing): ``rank``, ``world_size``,
``coords`` {tp,pp,dp,cp,ep}, ``layout`` {tp,pp,vpp,cp,ep,dp,sequence_parallel},
``model`` (ModelConfig fields), ``train`` (TrainConfig fields), ``device``,
``device_name``, ``num_microbatches``, ``num_parameters_local``,
``model_flops_per_step``, ``fusions`` (bool), ``memory_source`` ('cuda'|'rss'), ``steps`` [{step,
loss, grad_norm, lr, step_time_s, tokens_per_s, mem_allocated_bytes,
mem_peak_bytes, mem_reserved_bytes}], ``timeline`` [{step, stage, chunk, kind,
microbatch, start_s, end_s}], ``memory`` {peak_allocated_bytes,
peak_reserved_bytes, capacity_bytes}.

Pure Python: no torch, no numpy.  Timeline times of different ranks are
compared directly, which holds for ranks on one host (a shared monotonic
clock); across hosts the bubble is only as good as the clocks' agreement.
"""

from __future__ import annotations

import html
from dataclasses import fields
from functools import cached_property
from typing import Any, Iterable

from mnb import estimate
from mnb.analysis import run_memory, run_pipeline
from mnb.config import ModelConfig, ParallelConfig, TrainConfig
from mnb.estimate import hardware
from mnb.analysis.run_memory import MEASURED_COMPONENTS  # noqa: F401  (its old import path)
from mnb.units import Text



def _filtered(cls, data: dict[str, Any]):
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


class Run:
    """Per-rank records of one training run, with measured and predicted views.

    ``gpu`` (a hardware-table name) or ``peak_flops`` (per device) set the
    peak for MFU; otherwise it comes from ``device_name`` of a CUDA run, and
    CPU runs have no MFU (None).
    """

    def __init__(
        self,
        records: Iterable[dict[str, Any]],
        *,
        gpu: str | None = None,
        peak_flops: float | None = None,
    ) -> None:
        recs = sorted((dict(r) for r in records), key=lambda r: int(r.get("rank", 0)))
        if not recs:
            raise ValueError("a Run needs at least one rank record")
        self._records = recs
        self.gpu = gpu
        self.peak_flops = peak_flops

    # ----- structure -------------------------------------------------------------
    @property
    def records(self) -> list[dict[str, Any]]:
        return list(self._records)

    @property
    def records_by_rank(self) -> dict[int, dict[str, Any]]:
        """Each rank's record: ``{rank: record}``."""
        return {int(r.get("rank", i)): r for i, r in enumerate(self._records)}

    @property
    def ranks(self) -> dict[int, dict[str, Any]]:
        """The same as :attr:`records_by_rank` (the older name; it holds records, not rank numbers)."""
        return self.records_by_rank

    @property
    def first_record(self) -> dict[str, Any]:
        """Rank 0's record (fields every rank shares: model, train settings, device)."""
        return self._records[0]

    @property
    def world_size(self) -> int:
        return int(self.first_record.get("world_size") or len(self._records))

    @cached_property
    def layout(self) -> ParallelConfig:
        data = dict(self.first_record.get("layout") or {})
        parallel = _filtered(ParallelConfig, data)
        if parallel.dp is None:
            parallel = parallel.resolve(self.world_size)
        return parallel

    @cached_property
    def model(self) -> ModelConfig:
        return ModelConfig.from_dict(dict(self.first_record.get("model") or {}))

    @cached_property
    def train(self) -> TrainConfig:
        return _filtered(TrainConfig, dict(self.first_record.get("train") or {}))

    @property
    def num_microbatches(self) -> int:
        given = self.first_record.get("num_microbatches")
        return int(given) if given else self.train.num_microbatches(self.layout.dp or 1)

    @property
    def device_name(self) -> str | None:
        return self.first_record.get("device_name")

    @property
    def on_cpu(self) -> bool:
        return str(self.first_record.get("device", "cpu")).startswith("cpu")

    # ----- per-step measurements -----------------------------------------------------
    def _per_step(self, key: str) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for rec in self._records:
            for st in rec.get("steps") or []:
                value = st.get(key)
                if "step" in st:
                    out.setdefault(int(st["step"]), [])
                    if value is not None:
                        out[int(st["step"])].append(float(value))
        return dict(sorted(out.items()))

    @property
    def steps(self) -> list[int]:
        """The run's step numbers: the model's, from 1 (a second ``mnb.train`` call of 3 after 3: 4-6).

        The repr, the summary and every plot name steps by these numbers.
        """
        return list(self._per_step("step_time_s"))

    @property
    def losses(self) -> list[float | None]:
        """Loss per step: mean over the ranks that report one (the last pipeline stage)."""
        return [sum(v) / len(v) if v else None for v in self._per_step("loss").values()]

    @property
    def lrs(self) -> list[float | None]:
        """Learning rate per step (the schedule's, the same on every rank; as in Megatron-LM the
        lr a step's optimizer update used)."""
        return [v[0] if v else None for v in self._per_step("lr").values()]

    @property
    def eval_losses(self) -> list[float | None]:
        """Evaluation loss per step (``mnb.train(eval_data=..., eval_every=K)``); None at steps without one."""
        return [sum(v) / len(v) if v else None for v in self._per_step("eval_loss").values()]

    @property
    def packing(self) -> dict[str, Any] | None:
        """How full the training sequences were, for instruction data (``.jsonl`` rows); None for text.

        ``{"examples", "sequences", "packed", "fill", "loss_tokens"}``: ``fill`` is the share of the
        sequences' positions that hold example tokens (packing efficiency; the rest is padding),
        ``packed`` whether several examples shared a sequence (False: one each, padded).
        """
        return self.first_record.get("packing")

    @property
    def step_times_s(self) -> list[float | None]:
        """Step time per step: the slowest rank's."""
        return [max(v) if v else None for v in self._per_step("step_time_s").values()]

    @property
    def tokens_per_s(self) -> list[float | None]:
        """Tokens per second per step (as recorded, else global batch * seq / step time)."""
        recorded = self._per_step("tokens_per_s")
        tokens = self.num_microbatches * self.train.micro_batch_size * (self.layout.dp or 1) * self.model.seq_length
        out = []
        for (step, vals), t in zip(recorded.items(), self.step_times_s):
            if vals:
                out.append(min(vals))
            elif t:
                out.append(tokens / t)
            else:
                out.append(None)
        return out

    @property
    def model_flops_per_step(self) -> float:
        given = self.first_record.get("model_flops_per_step")
        if given:
            return float(given)
        gbs = self.num_microbatches * self.train.micro_batch_size * (self.layout.dp or 1)
        return estimate.flops(self.model, self.train, global_batch_size=gbs)

    @property
    def peak_flops_per_device(self) -> float | None:
        """Peak used for MFU: ``peak_flops``, ``gpu``, the CPU ranks' measured GEMM peak (the
        slowest rank's), or the CUDA device's datasheet entry in the hardware table."""
        if self.peak_flops:
            return float(self.peak_flops)
        dtype = hardware.train_dtype(self.train.bf16, self.train.fp8)
        if self.gpu:
            return hardware.peak_flops(self.gpu, dtype)
        measured = [float(r["peak_flops"]) for r in self._records if r.get("peak_flops")]
        if measured:
            return min(measured)
        if self.on_cpu:
            return None
        dev = hardware.device_from_name(self.device_name)
        return hardware.peak_flops(dev.name, dtype) if dev is not None else None

    @property
    def peak_source(self) -> str:
        """Which peak MFU is measured against, in words (for titles and summaries)."""
        peak = self.peak_flops_per_device
        if peak is None:
            return "no peak for this device"
        if self.peak_flops:
            return f"given peak {peak / 1e9:,.0f} GFLOP/s"
        if self.gpu:
            return f"{hardware.device(self.gpu).label} datasheet peak {peak / 1e12:,.0f} TFLOP/s"
        source = self.first_record.get("peak_source")
        if source:
            return f"{source} {peak / 1e9:,.0f} GFLOP/s"
        return f"datasheet peak {peak / 1e12:,.0f} TFLOP/s"

    @property
    def mfu(self) -> list[float | None]:
        """MFU per step (None without a peak, e.g. CPU runs without ``peak_flops``)."""
        peak = self.peak_flops_per_device
        if peak is None:
            return [None for _ in self.steps]
        f = self.model_flops_per_step
        return [
            estimate.mfu(flops_per_step=f, step_time_s=t, num_gpus=self.world_size, peak_flops=peak)
            if t else None
            for t in self.step_times_s
        ]

    @property
    def capacity_bytes(self) -> int | None:
        cap = (self.first_record.get("memory") or {}).get("capacity_bytes")
        return int(cap) if cap else None

    @property
    def fusions(self) -> bool:
        """Whether the ranks ran mnb's compiled fusions (``mnb.gpt(fusions=...)``)."""
        return bool(self.first_record.get("fusions", False))

    @property
    def unfused_steps(self) -> list[int]:
        """The steps (their numbers, as :attr:`steps`) that ran the fused ops unfused while their kernels
        compiled in the background (mnb.megatron.background_compile); [] when none did."""
        compiling = self._per_step("compiling")
        return [step for step, flags in compiling.items() if any(flags)]

    @property
    def kernel_waits(self) -> dict[int, float]:
        """{step: seconds} for the steps that waited for the fused kernels before they began, because
        unfused they would not have fit (mnb.megatron.background_compile.Steps); the longest wait of any rank."""
        waits = self._per_step("waited_for_kernels_s")
        return {step: max(values) for step, values in waits.items() if values}

    # ----- memory (mnb.analysis.run_memory) -------------------------------------------
    @property
    def peak_memory_bytes(self) -> dict[int, int]:
        """Measured peak bytes per rank (:func:`mnb.analysis.run_memory.peak_memory_bytes`)."""
        return run_memory.peak_memory_bytes(self)

    @property
    def measured_memory(self) -> dict[int, dict[str, int]]:
        """What each rank held, by component, in bytes (:func:`mnb.analysis.run_memory.measured_memory`)."""
        return run_memory.measured_memory(self)

    def predicted_components(self, rank: int) -> dict[str, float]:
        """The prediction for ``rank`` in the components of :attr:`measured_memory`
        (:func:`mnb.analysis.run_memory.predicted_components`)."""
        return run_memory.predicted_components(self, rank)

    def step_peak_bytes(self, steps: list[int]) -> int | None:
        """The most the CUDA allocator held in any of ``steps`` on any rank (each step's own peak);
        None on CPU ranks (whose per-step readings are the process's resident set) or without readings."""
        if self.memory_source != "cuda":
            return None
        peaks = self._per_step("mem_peak_bytes")
        values = [v for step in steps for v in peaks.get(step, [])]
        return int(max(values)) if values else None

    @property
    def memory_source(self) -> str:
        """Where the measured peak comes from: 'cuda' (allocator), 'counted' (tensors), or 'rss' (old records)."""
        return run_memory.memory_source(self)

    @cached_property
    def predicted_memory(self) -> estimate.MemoryEstimate:
        """mnb.estimate.memory for this run's model, layout and train settings."""
        return run_memory.predicted_memory(self)

    def stage_of_rank(self, rank: int) -> int:
        return run_memory.stage_of_rank(self, rank)

    # ----- pipeline (mnb.analysis.run_pipeline) ------------------------------------
    def timeline(self, step: int | None = None) -> list[dict[str, Any]]:
        """Timeline events of one step (default: the last), one rank per pipeline stage, times from the
        earliest stage's start (:func:`mnb.analysis.run_pipeline.timeline`)."""
        return run_pipeline.timeline(self, step)

    def timeline_steps(self) -> list[int]:
        return run_pipeline.timeline_steps(self)

    @property
    def measured_bubble_per_step(self) -> dict[int, float]:
        """Bubble per step (the idle share of the step's pipeline span, mean over stages)."""
        return run_pipeline.measured_bubble_per_step(self)

    @property
    def measured_bubble_by_stage(self) -> dict[int, float]:
        """Each stage's bubble: the median over steps after the first."""
        return run_pipeline.measured_bubble_by_stage(self)

    @property
    def measured_bubble(self) -> float | None:
        """The pipeline's bubble: median over steps after the first (robust on a loaded machine), in [0, 1]."""
        return run_pipeline.measured_bubble(self)

    @property
    def expected_bubble(self) -> float | None:
        """The schedule's bubble for the measured per-stage times
        (:func:`mnb.analysis.run_pipeline.expected_bubble`)."""
        return run_pipeline.expected_bubble(self)

    @property
    def theoretical_bubble(self) -> float:
        """The schedule's bubble for equal stages (:func:`mnb.estimate.bubble`)."""
        return run_pipeline.theoretical_bubble(self)

    # ----- steps ---------------------------------------------------------------------
    def step_ordinal(self, step: int) -> int:
        """Where the run's step number ``step`` stands in this run, counted from 1 (6 -> 3 in steps 4-6).

        The text and the plots name steps by their numbers (:attr:`steps`), not by this position.
        """
        steps = self.steps or self.timeline_steps()
        return steps.index(step) + 1 if step in steps else step

    @property
    def measured_bubble_statistic(self) -> str:
        """What :attr:`measured_bubble` is, in words the summary and the timeline's title share:
        ``"median of steps 2-10"`` (the run's step numbers, :attr:`steps`)."""
        per = self.measured_bubble_per_step
        return self.steps_note(self.steady_steps(list(per)), "median")

    @property
    def profiled_steps(self) -> list[int]:
        """The steps the profiler ran through on any rank (``--profile``, ``mnb.train(profile=)``): slower
        than the others, so the summary's means and the measured bubble leave them out when others remain."""
        return [step for step, flags in self._per_step("profiled").items() if any(flags)]

    def steady_steps(self, steps: list[int]) -> list[int]:
        """The steps a mean or median covers: after the first (warm-up) one, less the profiled ones,
        each only while steps remain."""
        steady = steps[1:] if len(steps) > 1 else steps
        profiled = set(self.profiled_steps)
        return [s for s in steady if s not in profiled] or steady

    def steps_note(self, used: list[int], statistic: str) -> str:
        """Which steps a figure covers, in words: ``"mean of steps 2-3, 5; profiled step 4 left out"``."""
        if not used:
            return "no step timed"
        text = (f"step {used[0]}" if len(used) == 1 else f"{statistic} of steps {_step_ranges(used)}")
        inside = [s for s in self.profiled_steps if s in used]
        left_out = [s for s in self.profiled_steps if s not in used]
        if inside:
            text += (", all profiled" if len(inside) == len(used)
                     else f", step{'s' if len(inside) > 1 else ''} {_step_ranges(inside)} profiled") + " (slowed by the profiler)"
        elif left_out:
            text += f"; profiled step{'s' if len(left_out) > 1 else ''} {_step_ranges(left_out)} left out"
        return text

    # ----- text ----------------------------------------------------------------------
    def summary(self) -> Text:
        """A few lines: loss, tokens/s, MFU, bubble, peak memory vs predicted (a str that shows as text)."""
        from mnb.analysis.run_summary import summary

        return summary(self)

    def __repr__(self) -> str:
        return f"<Run {self.model.name} {self.layout.describe()} steps={len(self.steps)}>\n{self.summary()}"

    def _repr_html_(self) -> str:
        body = "<br>".join(html.escape(line) for line in self.summary().splitlines())
        return f"<div><b>mnb run</b><br>{body}</div>"

    # ----- plots ---------------------------------------------------------------------
    def plot_memory(self, ax=None):
        from mnb.plot import plot_memory

        return plot_memory(self, ax=ax)

    def plot_timeline(self, ax=None, step: int | None = None):
        from mnb.plot import plot_timeline

        return plot_timeline(self, ax=ax, step=step)

    def plot_loss(self, ax=None):
        from mnb.plot import plot_loss

        return plot_loss(self, ax=ax)

    def plot_mfu(self, ax=None):
        from mnb.plot import plot_mfu

        return plot_mfu(self, ax=ax)

    # ----- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"records": self.records, "gpu": self.gpu, "peak_flops": self.peak_flops}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Run":
        return cls(data["records"], gpu=data.get("gpu"), peak_flops=data.get("peak_flops"))


def as_run(obj: Any) -> Run:
    """A :class:`Run` from a Run, a list of rank records, a single record or ``Run.to_dict()``.

    The one place that turns records into what plots read (``plot_memory(as_run(records))``);
    the plots themselves take any object with a run's fields.
    """
    if isinstance(obj, Run):
        return obj
    if isinstance(obj, dict) and "records" in obj:
        return Run.from_dict(obj)
    if isinstance(obj, dict):
        return Run([obj])
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(r, dict) for r in obj):
        return Run(obj)
    raise TypeError(f"expected a Run or rank records, got {type(obj).__name__}")


def _step_ranges(steps: list[int]) -> str:
    """``[2, 3, 5, 7, 8]`` -> ``"2-3, 5, 7-8"``."""
    runs: list[list[int]] = []
    for step in sorted(steps):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
