"""Measure the user's own Megatron training loop like ``mnb.train``, without changing it.

A cell or a ``%mnb run`` script that drives Megatron's schedules itself::

    forward_backward = get_forward_backward_func()
    for step in range(steps):
        ddp.zero_grad_buffer(); optimizer.zero_grad()
        losses = forward_backward(forward_step_func=..., data_iterator=..., model=[ddp], ...)
        optimizer.step()

leaves ``mnb.last_run`` with the same record ``mnb.train`` makes (schema in
:mod:`mnb.megatron.record`): :func:`install` (the worker calls it at start-up)
makes ``get_forward_backward_func`` (in ``megatron.core.pipeline_parallel`` and its
``schedules``) hand out a recording wrapper, so code that imports it afterwards --
the user's, Megatron-LM's ``training.py`` -- gets one.  Each training call
(``forward_only=False``) is one step:

- the per-microbatch timeline through ``config.timers`` (:class:`TimelineRecorder`;
  the user's own timers, e.g. Megatron-LM's, still get every call: :class:`_Tee`);
- memory per step and by component (:class:`MemoryMeter`, :class:`ComponentMeter`:
  weights and DDP gradient buffers of the model passed in; the optimizer's tensors
  from the optimizer that steps, seen through torch's global optimizer hooks);
- the loss the loss function reported (:func:`record.loss_sum_and_count`), on the
  last pipeline stage;
- model FLOPs from the model's ``TransformerConfig`` (:func:`record.describe_model`).

A step starts when its schedule call starts and ends when the optimizer that
stepped after it finishes (torch's ``register_optimizer_step_post_hook``), or when
the schedule call ends if no optimizer stepped.  The run is closed when the cell
ends (:func:`mnb.megatron.events.take_records`); ``mnb.train`` records itself and
is passed through.  ``mnb.record(False)`` turns this off; live progress needs the
number of steps, known from Megatron-LM's ``args.train_iters`` or
``mnb.record(steps=N)``.  Nothing here runs a collective: a step costs a few host
timestamps, plus one CUDA synchronize when it closes.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

from mnb.megatron import events
from mnb.megatron.memory import ComponentMeter, MemoryMeter
from mnb.megatron.timing import TimelineRecorder
from mnb.progress import Progress

logger = logging.getLogger(__name__)

_state = {"on": True, "steps": None}
_active: "_Run | None" = None


def record(on: bool = True, *, steps: int | None = None) -> bool:
    """Turn the measuring of the user's own schedule calls on or off; returns the previous setting.

    ``steps``: how many steps the next runs take, for the live progress bar (Megatron-LM's
    ``args.train_iters`` is read by itself).  Rank side, like ``mnb.train``: in a cell,
    ``mnb.record(False)`` before a script or loop that should not be measured.
    """
    previous = _state["on"]
    _state["on"] = bool(on)
    _state["steps"] = steps
    if not on:
        finish()
    return previous


def install() -> None:
    """Make ``get_forward_backward_func`` hand out recording wrappers (idempotent)."""
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_forward_backward_func
    if getattr(original, "_mnb_recording", False):
        return

    @functools.wraps(original)
    def get_forward_backward_func(*args: Any, **kwargs: Any):
        return _recording(original(*args, **kwargs))

    get_forward_backward_func._mnb_recording = True  # type: ignore[attr-defined]
    schedules.get_forward_backward_func = get_forward_backward_func
    pipeline_parallel.get_forward_backward_func = get_forward_backward_func
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_optimizer_starts)
    register_optimizer_step_post_hook(_optimizer_ends)
    events.on_take(finish)


def _recording(forward_backward):
    @functools.wraps(forward_backward)
    def call(*args: Any, **kwargs: Any):
        if not _state["on"] or kwargs.get("forward_only") or args:
            return forward_backward(*args, **kwargs)
        from megatron.core.utils import get_model_config

        models = kwargs["model"] if isinstance(kwargs.get("model"), list) else [kwargs.get("model")]
        config = get_model_config(models[0])
        if isinstance(getattr(config, "timers", None), TimelineRecorder):  # mnb.train records itself
            return forward_backward(*args, **kwargs)
        run = _run_for(config, models, int(kwargs["num_microbatches"]))
        run.begin(kwargs)
        own_timers = config.timers
        config.timers = _Tee(run.recorder, own_timers) if own_timers is not None else run.recorder
        try:
            losses = forward_backward(*args, **kwargs)
        finally:
            config.timers = own_timers
        run.schedule_done(losses)
        return losses

    return call


def _run_for(config, models: list, num_microbatches: int) -> "_Run":
    """The open run of this model, or a new one (closing the open run of another model)."""
    global _active
    if _active is not None and (_active.config is not config or _active.num_microbatches != num_microbatches):
        finish()
    if _active is None:
        _active = _Run(config, models, num_microbatches)
    return _active


def finish() -> None:
    """Close the open run, if any, and publish its record (every rank that ran it)."""
    global _active
    run, _active = _active, None
    if run is not None:
        run.close()


def _optimizer_starts(optimizer, args, kwargs) -> None:
    if _active is not None:
        _active.optimizer_starts(optimizer)


def _optimizer_ends(optimizer, args, kwargs) -> None:
    if _active is not None:
        _active.optimizer_ends(optimizer)


class _Tee:
    """``config.timers`` for both mnb's recorder and the user's own timers (Megatron-LM's ``Timers``)."""

    def __init__(self, recorder: TimelineRecorder, own: Any) -> None:
        self.recorder, self.own = recorder, own

    def __call__(self, name: str, log_level: int | None = None):
        return _TeeTimer(self.recorder(name, log_level), self.own(name, log_level=log_level))


class _TeeTimer:
    def __init__(self, *timers: Any) -> None:
        self.timers = timers

    def start(self, barrier: bool = False) -> None:
        for timer in self.timers:
            timer.start(barrier=barrier)

    def stop(self, barrier: bool = False) -> None:
        for timer in reversed(self.timers):
            timer.stop(barrier=barrier)


class _Run:
    """One model's schedule calls in one cell or script: this rank's record, step by step."""

    def __init__(self, config, models: list, num_microbatches: int) -> None:
        from megatron.core import parallel_state as ps

        from mnb.megatron.record import device_of

        self.config, self.models, self.num_microbatches = config, models, num_microbatches
        self.device = device_of()
        self.meter = MemoryMeter(self.device)
        self.components = ComponentMeter()
        self.chunks = [_unwrap(m) for m in models]
        self.holder = SimpleNamespace(chunks=self.chunks, wrapped=[m for m in models if hasattr(m, "buffers")])
        self.components.count_static(self.holder, [])
        pp = ps.get_pipeline_model_parallel_world_size()
        self.recorder = TimelineRecorder(
            stage=ps.get_pipeline_model_parallel_rank(), num_microbatches=num_microbatches,
            num_chunks=len(models), device=self.device, on_stop=self.meter.sample, listener=self.components,
            group_size=getattr(config, "microbatch_group_size_per_vp_stage", None) or pp,
        )
        self.reports = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                        and ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
        self.parallel, self.coords = _layout_now(config)  # a script may destroy its parallel state before the end
        self.optimizers: list = []
        self.rows: list[dict] = []
        self.timeline: list[dict] = []
        self.open = False
        self.call: dict[str, Any] = {}

    # ----- one step: the schedule call, then the optimizer
    def begin(self, kwargs: dict[str, Any]) -> None:
        self.close_step()
        self.call = {"micro_batch_size": int(kwargs.get("micro_batch_size") or 1),
                     "seq_length": int(kwargs.get("seq_length") or 0), "losses": None}
        self.meter.begin_step()
        self.recorder.begin_step(len(self.rows) + 1)  # steps are numbered from 1, as mnb.train's
        self.t0 = self.end = time.perf_counter()
        self.optimizer_span = None
        self.open = True

    def schedule_done(self, losses: Any) -> None:
        self.call["losses"] = losses
        self.end = time.perf_counter()

    def optimizer_starts(self, optimizer) -> None:
        if self.open and self.optimizer_span is None:
            self.optimizer_span = self.recorder.span("optimizer")
            self.optimizer_span.__enter__()

    def optimizer_ends(self, optimizer) -> None:
        if not self.open:
            return
        if self.optimizer_span is not None:
            self.optimizer_span.__exit__(None, None, None)
            self.optimizer_span = None
        if all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        self.end = time.perf_counter()

    def close_step(self) -> None:
        if not self.open:
            return
        self.open = False
        from mnb.megatron.record import loss_sum_and_count

        step_time = self.end - self.t0
        total, count = loss_sum_and_count(self.call["losses"] if isinstance(self.call["losses"], list) else [])
        tokens = self.call["micro_batch_size"] * self.num_microbatches * self.parallel.dp * self.call["seq_length"]
        lr = next((float(g["lr"]) for o in self.optimizers for g in getattr(o, "param_groups", [])[:1]), None)
        row = {"step": len(self.rows) + 1, "loss": total / count if count else None, "grad_norm": None, "lr": lr,
               "step_time_s": step_time, "tokens_per_s": tokens / step_time if step_time > 0 and tokens else None,
               **self.meter.end_step()}
        self.rows.append(row)
        self.timeline.extend(self.recorder.end_step())
        if len(self.rows) <= ComponentMeter.COUNTED_STEPS:  # Adam's moments exist after the first step
            self.components.count_static(self.holder, self.optimizers)
        total_steps = _state["steps"] or _train_iters()
        if self.reports and total_steps:
            events.emit("progress", Progress(step=len(self.rows), steps=total_steps, global_step=row["step"],
                                             loss=row["loss"], tokens_per_s=row["tokens_per_s"],
                                             step_time_s=step_time).as_payload())

    def close(self) -> None:
        self.close_step()
        self.components.end_run()
        if not self.rows:
            return
        try:
            events.publish_record(self._record())
        except Exception as exc:  # a record that cannot be built must not fail the user's cell
            logger.warning("mnb could not build the run record of this loop: %s: %s", type(exc).__name__, exc)
            print(f"mnb: no run record for this loop ({type(exc).__name__}: {exc})", file=sys.stderr)

    def _record(self) -> dict:
        from mnb.config import TrainConfig
        from mnb.megatron.record import build_record, describe_model, model_flops_per_step

        mbs, seq, dp = self.call["micro_batch_size"], self.call["seq_length"], self.parallel.dp
        model_config, vocab = describe_model(self.config, self.chunks, seq)
        lr = next((r["lr"] for r in self.rows if r["lr"]), None)
        train = TrainConfig(steps=len(self.rows), micro_batch_size=mbs, global_batch_size=mbs * dp * self.num_microbatches,
                            lr=lr or TrainConfig().lr, bf16=bool(self.config.bf16), fp8=bool(self.config.fp8),
                            data="the user's data_iterator")
        self.components.count_static(self.holder, self.optimizers)
        holder = SimpleNamespace(parallel=self.parallel, config=model_config, padded_vocab_size=vocab, fusions=False,
                                 num_parameters_local=lambda: sum(p.numel() for c in self.chunks for p in c.parameters()))
        record = build_record(
            model=holder, train=train, device=self.device, num_microbatches=self.num_microbatches, steps=self.rows,
            timeline=self.timeline, meter=self.meter, components=self.components,
            flops=model_flops_per_step(model_config, train.global_batch_size, vocab))
        record["coords"] = self.coords
        record["source"] = "get_forward_backward_func"
        return record


def _layout_now(config):
    """Megatron's current layout as a ParallelConfig, and this rank's coordinates."""
    from megatron.core import parallel_state as ps

    from mnb.config import ParallelConfig

    parallel = ParallelConfig(
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1, cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(), dp=ps.get_data_parallel_world_size(),
        sequence_parallel=bool(getattr(config, "sequence_parallel", False)))
    coords = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
              "dp": ps.get_data_parallel_rank(), "cp": ps.get_context_parallel_rank(),
              "ep": ps.get_expert_model_parallel_rank()}
    return parallel, coords


def _unwrap(module):
    """The model inside DDP / Float16Module wrappers (their ``.module``)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def _train_iters() -> int | None:
    """Megatron-LM's ``args.train_iters`` when its ``pretrain()`` is running here."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None) if global_vars else None
    return getattr(args, "train_iters", None)
