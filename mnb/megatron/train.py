"""``mnb.train``: train a :class:`~mnb.megatron.model.MegatronModel` on Megatron's own path.

Inside a ``%%megatron`` cell, on every rank::

    model = mnb.gpt("tiny")
    record = mnb.train(model, steps=20, micro_batch_size=2, global_batch_size=8,
                       lr=3e-4, data="mock")
    record = mnb.train(model, steps=20)      # continues: same DDP, optimizer, schedule, data position

The path is Megatron-LM's: ``get_forward_backward_func`` (1F1B, interleaved
for vpp), Megatron ``DistributedDataParallel`` (grads in ``main_grad``),
``get_megatron_optimizer`` (Adam; distributed optimizer optional),
``finalize_model_grads``, ``OptimizerParamScheduler`` (warmup, then constant
/ linear / cosine decay over ``schedule_steps``, default the first call's steps; as in
Megatron-LM the first warmup step runs at lr 0; kept on the model with its step count,
:mod:`mnb.megatron.schedule`), ``Float16Module`` for bf16.  A later call continues with
the settings earlier calls named unless it names others.  The loss is the average per-token loss over the global batch
(``calculate_per_token_loss``): independent of how the batch is split across
dp ranks and microbatches, so layouts can be compared step by step.

Each call returns this rank's run record (schema in :mod:`mnb.megatron.record`)
and publishes it through :mod:`mnb.megatron.events`.

Your own model and step, with Megatron's own signatures (any ``MegatronModule``
built under the current layout, e.g. a ``GPTModel`` from your model provider)::

    record = mnb.train(my_gpt, forward_step_func=forward_step, data_iterator=it, steps=20,
                       micro_batch_size=2, global_batch_size=8, seq_length=512)

``forward_step_func(data_iterator, model) -> (output, loss_func)`` and ``loss_func(output)
-> (loss, {"name": value})`` or ``(loss, num_tokens, {...})`` as in Megatron-LM; the
step's loss is the average of the first reported value (a ``[sum, count]`` pair is
summed).  mnb adds DDP, the optimizer, the schedule and the instruments; a second
call continues with the same DDP and optimizer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from mnb.config import TrainConfig, interleave_problem
from mnb.megatron import background_compile, events, fp8, interrupts, schedule, wgrad_fusion
from mnb.megatron import layout as _layout
from mnb.megatron.batches import BatchPlan, microbatch_iterators
from mnb.megatron.memory import ComponentMeter, MemoryMeter
from mnb.megatron.model import MegatronModel
from mnb.megatron.record import build_record, device_of, model_flops_per_step
from mnb.megatron.timing import TimelineRecorder, time_token_dispatch
from mnb.progress import Progress
from mnb.results import TrainResult
from mnb.units import format_bytes

logger = logging.getLogger(__name__)


def train_config(**fields: Any) -> TrainConfig:
    """A TrainConfig from keyword fields, with a clear error for unknown names."""
    schedule.check_names(fields)
    return TrainConfig(**fields)


def _set_recompute(model: MegatronModel, recompute: str) -> None:
    """Megatron reads the full-recompute flags at run time, selective ones at build time."""
    config = model.transformer_config
    if recompute == "full":
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = (
            "full", "uniform", 1,
        )
    else:
        config.recompute_granularity = "selective" if recompute == "selective" else None
        config.recompute_method, config.recompute_num_layers = None, None
    selective = recompute == "selective" and "core_attn" in (config.recompute_modules or ["core_attn"])
    for chunk in model.chunks:
        for module in chunk.modules():
            if hasattr(module, "checkpoint_core_attention"):
                module.checkpoint_core_attention = selective


def _prepare(model: MegatronModel, tc: TrainConfig) -> None:
    """Wrap the chunks (bf16, DDP) and build the optimizer once per model."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from mnb.megatron.spec import fp8_supported

    precision = "bf16" if tc.bf16 else "fp32"
    if tc.fp8 and not fp8_supported():
        raise ValueError("fp8=True is Transformer Engine's FP8 and needs TE and a Hopper-or-newer GPU on every "
                         "rank; without TE build the model with FP8 linears: mnb.gpt(..., fp8='tensorwise', "
                         "'rowwise' or 'delayed'), and train it with bf16=True")
    local_fp8 = getattr(model.config, "fp8", None)
    if local_fp8 is not None and tc.fp8:
        raise ValueError(f"this model's linears already run FP8 (mnb.gpt(..., fp8={local_fp8!r})); fp8=True asks "
                         "for Transformer Engine's recipe on top: drop fp8=True from mnb.train")
    if local_fp8 is not None and not tc.bf16:
        raise ValueError(f"this model's linears run FP8 (fp8={local_fp8!r}), which takes bf16 activations and "
                         "weights: train it with bf16=True")
    config = model.transformer_config
    strategy = _fsdp_strategy(model)
    distributed = tc.use_distributed_optimizer or strategy is not None  # implied by Megatron-FSDP
    if model.wrapped is not None:
        if (model.precision, model.use_distributed_optimizer) != (precision, distributed):
            raise ValueError(
                f"this model trains in {model.precision} with use_distributed_optimizer="
                f"{model.use_distributed_optimizer}; to change to {precision} / "
                f"{distributed} build a new model (mnb.gpt) or save and load it"
            )
    else:
        config.bf16 = tc.bf16
        config.pipeline_dtype = torch.bfloat16 if tc.bf16 else torch.float32
        modules = [Float16Module(config, c) if tc.bf16 else c for c in model.chunks]
        if strategy is not None:  # Megatron-FSDP (mnb.megatron.fsdp); pp is 1, so one chunk
            from mnb.megatron import fsdp

            model.wrapped = [fsdp.wrap(config, m, strategy, device_of()) for m in modules]
        else:
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=tc.use_distributed_optimizer,
            )
            model.wrapped = [
                DistributedDataParallel(config, ddp_config, m, disable_bucketing=i > 0)
                for i, m in enumerate(modules)
            ]
        if strategy is None:  # FSDP's broadcast_params broadcasts DTensors (no sharding rule for it);
            for wrapped in model.wrapped:  # mnb's initial weights are the same on every dp rank anyway
                wrapped.broadcast_params()
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=tc.lr,
            min_lr=tc.min_lr,
            weight_decay=tc.weight_decay,
            adam_beta1=tc.adam_beta1,
            adam_beta2=tc.adam_beta2,
            clip_grad=tc.clip_grad,
            bf16=tc.bf16,
            params_dtype=torch.float32,
            use_distributed_optimizer=distributed,
        )
        model.optimizer = get_megatron_optimizer(opt_config, model.wrapped)
        model.precision, model.use_distributed_optimizer = precision, distributed
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = model.optimizer.scale_loss
        no_sync = [w.no_sync for w in model.wrapped]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.fp8 = "hybrid" if tc.fp8 else None
    if not model.user_model or tc.recompute != "none":  # your own model keeps its own recompute settings
        _set_recompute(model, tc.recompute)
    for opt in _sub_optimizers(model.optimizer):
        opt.config.clip_grad = tc.clip_grad
        for group in opt.param_groups:
            group["betas"] = (tc.adam_beta1, tc.adam_beta2)
        _use_fused_adam(getattr(opt, "optimizer", None))


def _fsdp_strategy(model: MegatronModel) -> str | None:
    """The Megatron-FSDP strategy ``model`` trains with: the one it was wrapped with, else the layout's.

    ``--fsdp`` changes no process group, so a model built before a cell changed only ``--fsdp``
    is still alive: it is wrapped by its first ``mnb.train``, under that cell's ``fsdp``, and a
    later cell asking for another wrapping gets an error instead of a silent mix.  Under FSDP the
    optimizer is always Megatron's distributed one (``use_distributed_optimizer`` is implied).
    """
    import dataclasses

    layout = _layout.current_layout()
    wanted = layout.fsdp if layout is not None else None
    if model.wrapped is not None:
        if (model.parallel.fsdp or None) != wanted:
            raise ValueError(
                f"this model is wrapped with fsdp={model.parallel.fsdp!r} but the cell runs with fsdp={wanted!r}; "
                f"run it under the same --fsdp, or build a new model (mnb.gpt) or save and load it"
            )
        return wanted
    from mnb.megatron import cpu

    if wanted == "optim" and cpu.installed():
        from mnb.config import FSDP_OPTIM_ON_CPU

        raise ValueError(FSDP_OPTIM_ON_CPU)
    if wanted is not None and getattr(model, "lora", None) is not None and not _fsdp_skips_frozen():
        import megatron.core

        raise ValueError(f"Megatron-FSDP in megatron-core {megatron.core.__version__} hooks every parameter's "
                         f"gradient, the frozen ones too, so --fsdp ({wanted}) cannot train LoRA adapters here: "
                         "drop --fsdp (Megatron DDP; the adapters are small), or use megatron-core 0.19")
    if wanted is not None and model.user_model:
        raise ValueError(f"--fsdp ({wanted}) wraps models built by mnb.gpt / mnb.from_hf; "
                         "your own module trains with Megatron DDP: drop --fsdp")
    model.parallel = dataclasses.replace(model.parallel, fsdp=wanted)
    return wanted


def _fsdp_skips_frozen() -> bool:
    """Whether this Megatron-FSDP leaves frozen parameters alone (0.19 does; 0.16 hooks them and fails)."""
    import inspect

    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp

    return "if not param.requires_grad" in inspect.getsource(megatron_fsdp.MegatronFSDP._register_fsdp_hooks)


def _use_fused_adam(inner) -> None:
    """torch's fused Adam step (one kernel per tensor group) where Megatron fell back to torch's Adam.

    Without Transformer Engine or apex, Megatron builds ``torch.optim.AdamW`` with its default,
    the multi-tensor ``foreach`` step, which reads and writes each fp32 state several times;
    ``fused`` does it in one pass.  Only for groups whose parameters are all on a GPU in a
    floating dtype and whose step counters (if any, e.g. after ``mnb.load``) are on the same
    device, as the fused kernel requires; anything else keeps Megatron's choice.
    """
    if type(inner) not in (torch.optim.AdamW, torch.optim.Adam):
        return
    for group in inner.param_groups:
        params = group["params"]
        on_gpu = bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
        steps_fit = all(
            isinstance(inner.state[p].get("step"), torch.Tensor) and inner.state[p]["step"].device == p.device
            for p in params if "step" in inner.state.get(p, {})
        )
        if on_gpu and steps_fit and not group.get("differentiable") and not group.get("capturable"):
            group["fused"], group["foreach"] = True, False


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _forward_step(data_iterator, model):
    """Megatron forward_step_func: :func:`mnb.megatron.batches.forward_step` (mnb.evaluate's too)."""
    from mnb.megatron.batches import forward_step

    return forward_step(data_iterator, model)


def _holds_loss() -> bool:
    """True on the ranks whose loss sums make up the global batch: last stage, first tp rank.

    Every dp rank and every cp rank there holds the loss of a disjoint part of
    the global batch's tokens; tp ranks hold copies.
    """
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0


def _global_loss(losses_reduced: list[dict], device, interrupted: bool = False, own=None,
                 switch: background_compile.Steps | None = None) -> tuple[float, bool]:
    """Average per-token loss over the global batch, and whether any rank was interrupted.

    Both are identical on every rank: the interrupt flag rides along in the
    loss's all-reduce, so every rank stops after the same step; so does each rank's
    readiness of the fused kernels (``switch``: the next step runs them once every rank
    has them).  With your own loss function (``own``), the average of what it reported
    (record.loss_sum_and_count).
    """
    totals = torch.zeros(5, dtype=torch.float64, device=device)
    if _holds_loss() and own is not None:
        from mnb.megatron.record import loss_sum_and_count

        totals[0], totals[1] = loss_sum_and_count(losses_reduced)
    elif _holds_loss():
        for item in losses_reduced:
            totals[:2] += item["lm loss"].to(device=device, dtype=torch.float64)
    totals[2] = float(interrupted)
    if switch is not None:
        totals[3], totals[4] = switch.votes()
    torch.distributed.all_reduce(totals)
    if switch is not None:
        switch.decide(float(totals[3]), float(totals[4]))
    loss = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
    return loss, bool(totals[2] > 0)


def _oom_error(err: BaseException, step: int, meter: MemoryMeter) -> torch.OutOfMemoryError:
    coords = _layout.coordinates()
    layout = _layout.current_layout()
    mem = meter.now()
    capacity = f" of {format_bytes(mem['capacity'])}" if mem["capacity"] else ""
    return torch.OutOfMemoryError(
        f"rank {torch.distributed.get_rank()} (tp{coords['tp']} pp{coords['pp']} dp{coords['dp']}; "
        f"pipeline stage {coords['pp']} of {layout.pp if layout else 1}) ran out of memory at "
        f"step {step}: allocated {format_bytes(mem['allocated'])}, peak {format_bytes(mem['peak'])}, reserved "
        f"{format_bytes(mem['reserved'])}{capacity} ({meter.source}). Try a smaller micro_batch_size, "
        f"recompute='selective' or 'full', bf16=True, use_distributed_optimizer=True, or more tp/pp. "
        f"Original error: {err}"
    )


def train(model: Any, *, steps: int | None = None, micro_batch_size: int | None = None,
          global_batch_size: int | None = None, lr: float | None = None, data: str | None = None,
          forward_step_func=None, data_iterator=None, seq_length: int | None = None, profile: Any = None,
          **fields: Any) -> dict:
    """Train ``model`` for ``steps`` steps; return this rank's run record (see module doc), a dict
    whose repr is one line (:class:`mnb.results.TrainResult`).

    Keyword arguments are :class:`mnb.config.TrainConfig` fields; unset ones take what
    earlier calls on this model named, else its defaults (``schedule_steps``: the model's
    schedule, else this call's ``steps``).  ``model`` is what ``mnb.gpt`` returned, or your own Megatron
    module with ``forward_step_func`` and ``data_iterator`` (``seq_length``: the
    schedule's, default the model's ``max_sequence_length``).  Must be called on
    every rank of the pool.  ``profile``: steps of this call to profile (``3`` or ``"3-4"``, from 1;
    :mod:`mnb.megatron.profile`), read in the notebook as ``mnb.last_profile``.
    """
    from mnb.megatron import profile as _profile

    own = None
    if forward_step_func is not None or not isinstance(model, MegatronModel):
        from mnb.megatron.own import OwnStep

        own = OwnStep.of(model, forward_step_func, data_iterator, seq_length)
        model = own.model
    with _profile.train_steps(profile) as session, interrupts.deferred() as flag:
        # set-up runs collectives too: never cut it on one rank
        return _train(model, flag, own=own, session=session, steps=steps, micro_batch_size=micro_batch_size,
                      global_batch_size=global_batch_size, lr=lr, data=data, **fields)


def _train(model: MegatronModel, flag: interrupts.InterruptFlag, own=None, session=None, **settings: Any) -> dict:
    from megatron.core import parallel_state as ps

    given = {k: v for k, v in settings.items() if v is not None}
    tc = schedule.call_config(model, given)  # what earlier calls named carries over (mnb.megatron.schedule)
    if tc.eval_every and not tc.eval_data:
        raise ValueError(f"eval_every={tc.eval_every} needs eval_data= (held-out data: 'stdlib', a text "
                         "folder, a .bin/.idx prefix or 'mock')")
    model.check_layout()
    unprofiled = session.past_the_end(tc.steps) if session is not None else ""
    if unprofiled:
        raise ValueError(unprofiled)
    if own is None:  # instruction rows read and checked alike on every rank, before any collective
        from mnb.megatron import instructions

        for data in (tc.data, tc.eval_data):
            instructions.check(model, data, truncate=tc.truncate)
    parallel = model.parallel
    num_microbatches = tc.num_microbatches(parallel.dp)
    problem = interleave_problem(num_microbatches, parallel.pp, parallel.vpp, tc.micro_batch_size * parallel.dp)
    if problem:  # alike on every rank, before any collective: Megatron's own refusal comes from inside the schedule
        raise ValueError(problem)
    device = device_of()
    _prepare(model, tc)
    scheduler = schedule.scheduler_for(model, tc, _sub_optimizers(model.optimizer))
    schedule.remember(model, given, tc)
    schedule.warn_past_end(model, tc, torch.distributed.get_rank())
    config = model.transformer_config
    meter = MemoryMeter(device)
    components = ComponentMeter()
    components.count_static(model, _sub_optimizers(model.optimizer))
    if session is not None:  # --profile --memory: the counted tensors over the profiled steps
        session.watch(components)
    recorder = TimelineRecorder(
        stage=ps.get_pipeline_model_parallel_rank(),
        num_microbatches=num_microbatches,
        num_chunks=len(model.chunks),
        group_size=getattr(config, "microbatch_group_size_per_vp_stage", None) or parallel.pp,
        device=device,
        on_stop=meter.sample,
        listener=components,
    )
    plan = BatchPlan(
        start_sample=model.consumed_samples,
        micro_batch_size=tc.micro_batch_size,
        num_microbatches=num_microbatches,
        dp=parallel.dp,
        dp_rank=ps.get_data_parallel_rank(),
    )
    # Sample k is the same however long the run (batches.EpochSamples): steps=10 and steps=20 start
    # alike, and one call of 10 steps and two of 5 read the same samples.
    dataset = plan.dataset(tc, model) if own is None else None
    switch = background_compile.Steps(fused=model.fusions, device=device, keys=model.compile_keys)
    with switch:
        if _agree_to_stop(flag, device, switch):
            raise KeyboardInterrupt(f"mnb.train stopped before its first step on every rank "
                                    f"(steps_done={model.steps_done}); nothing was trained")
        config.timers = recorder
        try:
            with time_token_dispatch(model.chunks, recorder), wgrad_fusion.fused(model.chunks, device):
                step_rows, timeline, stopped = _run_steps(model, tc, plan, dataset, scheduler, recorder, meter,
                                                          device, flag, own, session, switch)
        finally:
            config.timers = None
            components.end_run()
    components.count_static(model, _sub_optimizers(model.optimizer))  # Adam's moments exist now
    record = build_record(
        model=model, train=tc, device=device, num_microbatches=num_microbatches,
        steps=step_rows, timeline=timeline, meter=meter, components=components,
        flops=model_flops_per_step(model.config, plan.global_batch_size, model.padded_vocab_size, model.lora),
    )
    record["packing"] = getattr(dataset, "packing", None)  # instruction data: how full the sequences are
    record["data_prefix"] = getattr(dataset, "data_prefix", None)  # text data: the .bin/.idx it read
    events.publish_record(record)
    if stopped or flag.requested:
        # Every rank stopped after the same step (see mnb.megatron.interrupts): the cell ends here.
        # step numbers are the model's, counting on across calls (as mnb.last_run's are)
        raise KeyboardInterrupt(
            f"mnb.train stopped after step {model.steps_done} on every rank ({len(step_rows)} of this call's "
            f"{tc.steps}); mnb.train(model, ...) continues from there"
        )
    return TrainResult(record)  # the same dict, shown as one line (mnb.results)


def _agree_to_stop(flag: interrupts.InterruptFlag, device, switch: background_compile.Steps) -> bool:
    """Whether any rank was interrupted during set-up: one all-reduce, so all ranks answer alike.

    It also decides whether the first step runs the compiled fused kernels (every rank has them).
    """
    raised = torch.tensor([float(flag.requested), *switch.votes()], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(raised)
    switch.decide(float(raised[1]), float(raised[2]))
    return bool(raised[0].item() > 0)


def _run_steps(model, tc, plan, dataset, scheduler, recorder, meter, device, flag, own=None, session=None,
               switch=None):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    seq = model.config.seq_length
    tokens_per_step = plan.global_batch_size * seq
    reports = (_holds_loss() and ps.get_data_parallel_rank() == 0
               and ps.get_context_parallel_rank() == 0)
    step_rows, timeline, stop = [], [], False
    for i in range(tc.steps):
        step = model.steps_done + 1  # the model's step number, from 1 (Megatron-LM's iteration): 4-6 after 3
        if session is not None:
            session.step_begin(i + 1, step)
        meter.begin_step()
        recorder.begin_step(step)
        t0 = time.perf_counter()
        compiled = switch is None or switch.compiled  # decided at the last boundary, the same on every rank
        waited_s = None if switch is None else switch.waited_s
        if switch is not None:
            switch.begin_step()
        try:
            for wrapped in model.wrapped:
                wrapped.zero_grad_buffer()
            model.optimizer.zero_grad()
            with fp8.weight_cache():  # FP8 linears: each weight cast once per step, not per microbatch
                losses = forward_backward(
                    forward_step_func=_forward_step if own is None else own.forward_step_func,
                    data_iterator=(microbatch_iterators(dataset, plan, i, model.chunks, device) if own is None
                                   else own.data_iterator),
                    model=model.wrapped,
                    num_microbatches=plan.num_microbatches,
                    seq_length=seq,
                    micro_batch_size=tc.micro_batch_size,
                    decoder_seq_length=seq,
                    forward_only=False,
                )
            step_lr = float(_sub_optimizers(model.optimizer)[0].param_groups[0]["lr"])
            with recorder.span("optimizer"):
                _, grad_norm, _ = model.optimizer.step()
            scheduler.step(increment=1)
            loss, stop = _global_loss(losses, device, flag.requested, own, switch)
        except torch.OutOfMemoryError as err:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            raise _oom_error(err, step, meter) from err
        # a wait for the kernels at this step's end belongs to the next step's row (waited_for_kernels_s)
        step_time = time.perf_counter() - t0 - ((switch.waited_s or 0.0) if switch is not None else 0.0)
        profiled = session is not None and session.step_end(i + 1, step)
        row = {
            "step": step,
            "loss": loss,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "lr": step_lr,
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_step / step_time if step_time > 0 else None,
            **meter.end_step(),
        }
        if model.fusions:
            row["compiling"] = not compiled  # ran the fused ops unfused while their kernels compiled
            if waited_s is not None:  # it waited for them: unfused it would not have fit (background_compile)
                row["waited_for_kernels_s"] = waited_s
        if profiled:
            row["profiled"] = True  # the profiler ran through it: slower than the others (Run.profiled_steps)
        if tc.eval_due(i + 1):
            stop = _evaluate_now(model, tc, flag, row) or stop
        step_rows.append(row)
        timeline.extend(recorder.end_step())
        model.steps_done += 1
        model.consumed_samples += plan.global_batch_size
        if reports:
            events.emit("progress", Progress(step=i + 1, steps=tc.steps, global_step=step, loss=loss,
                                             tokens_per_s=row["tokens_per_s"], step_time_s=step_time,
                                             eval_loss=row.get("eval_loss")).as_payload())
        if stop:
            break
    return step_rows, timeline, stop


def _evaluate_now(model, tc, flag, row: dict) -> bool:
    """``mnb.evaluate`` on ``tc.eval_data`` at a step boundary: ``row["eval_loss"]``; whether to stop."""
    from mnb.megatron.evaluate import run_evaluation

    result, stop = run_evaluation(model, tc.eval_data, tc.eval_batches, tc.micro_batch_size, flag,
                                  pack=tc.pack, truncate=tc.truncate)
    row["eval_loss"] = result["loss"]
    return stop
