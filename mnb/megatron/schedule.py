"""The learning-rate schedule that lives with a model, so a later ``mnb.train`` continues it.

Megatron-LM builds one ``OptimizerParamScheduler`` per run (warm-up, then constant /
linear / cosine decay over ``--lr-decay-iters``; weight decay from ``start_wd`` to
``end_wd``) and saves it in its checkpoints as ``opt_param_scheduler``.  mnb keeps it
on the model beside the optimizer (``model.scheduler``), with the settings that made it
(``model.train_settings``: what earlier calls named), so::

    mnb.train(model, steps=5, schedule_steps=10, warmup_steps=2, lr_decay_style="cosine")
    mnb.train(model, steps=5)        # steps 5-9 of the same 10-step schedule, same data stream

gives the learning rate and the loss of ``mnb.train(model, steps=10, warmup_steps=2,
lr_decay_style="cosine")`` at every step; :mod:`mnb.megatron.checkpoint` saves both
(``mnb.json``: ``train_settings`` and the scheduler's own ``state_dict``) and
:func:`restore` rebuilds them after a load, in any layout.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import warnings
from typing import Any

from mnb.config import TrainConfig, train_settings_problem
from mnb.paths import in_mnb

logger = logging.getLogger(__name__)

def check_names(given: dict[str, Any]) -> None:
    """TypeError naming the settings that are not TrainConfig fields, with the valid ones."""
    problem = train_settings_problem(given)  # mnb.train's own arguments are bound before: never in ``given``
    if problem:
        raise TypeError(problem)


def call_config(model: Any, given: dict[str, Any]) -> TrainConfig:
    """This call's settings: what it names, else what the model's earlier calls named, else the defaults.

    ``schedule_steps`` comes out resolved: named, else the model's schedule, else (a model's
    first call) this call's ``steps``.  Unknown names raise TypeError with the valid ones.
    """
    check_names(given)
    merged = {**getattr(model, "train_settings", {}), **given}
    tc = TrainConfig(**merged)
    return tc if tc.schedule_steps is not None else dataclasses.replace(tc, schedule_steps=tc.steps)


def remember(model: Any, given: dict[str, Any], tc: TrainConfig) -> None:
    """Keep what this call named (all but ``steps``) and the schedule's length for the next call."""
    kept = {**getattr(model, "train_settings", {}), **given, "schedule_steps": tc.schedule_steps}
    kept.pop("steps", None)
    model.train_settings = kept


def _settings(tc: TrainConfig) -> dict[str, Any]:
    """OptimizerParamScheduler arguments for ``tc`` (as in Megatron-LM the first warm-up step runs at lr 0)."""
    length = tc.schedule_steps or tc.steps
    tc.check_schedule(length)
    return dict(
        init_lr=0.0 if tc.warmup_steps else tc.lr, max_lr=tc.lr, min_lr=tc.min_lr,
        lr_warmup_steps=tc.warmup_steps, lr_decay_steps=max(length, tc.warmup_steps + 1),
        lr_decay_style=tc.lr_decay_style, start_wd=tc.weight_decay, end_wd=tc.weight_decay,
        wd_incr_steps=length, wd_incr_style="constant",
    )


def scheduler_for(model: Any, tc: TrainConfig, sub_optimizers: list):
    """The model's scheduler set to ``tc`` (built on its first call), its step count kept; lr applied now."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    settings = _settings(tc)
    scheduler = getattr(model, "scheduler", None)
    if scheduler is None or scheduler.optimizer is not model.optimizer:
        scheduler = OptimizerParamScheduler(model.optimizer, **settings)
        model.scheduler = scheduler
    else:  # a later call: the settings it names take effect from the current step on
        for name, value in settings.items():
            setattr(scheduler, name, value)
    for opt in sub_optimizers:  # Megatron's param groups carry the first call's lr as max_lr / min_lr
        for group in opt.param_groups:
            if "max_lr" in group:
                group["max_lr"] = tc.lr
            if "min_lr" in group:
                group["min_lr"] = tc.min_lr
    scheduler.step(increment=0)
    return scheduler


def warn_past_end(model: Any, tc: TrainConfig, rank: int) -> None:
    """Say once (rank 0) when this call runs past the end of a decaying schedule: those steps run at min_lr."""
    done = model.scheduler.num_steps
    if rank == 0 and tc.lr_decay_style != "constant" and done + tc.steps > tc.schedule_steps:
        warnings.warn(
            f"mnb.train: the {tc.lr_decay_style} schedule of {tc.schedule_steps} steps is at step {done}; "
            f"the {done + tc.steps - tc.schedule_steps} step(s) of this call after its end run at "
            f"min_lr={tc.min_lr}; pass schedule_steps=... (counted from the model's first step) for a "
            "longer schedule", stacklevel=_outside_mnb())


def _outside_mnb() -> int:
    """``warnings.warn``'s stacklevel, for a warning called from here, of the first frame outside mnb: the
    user's cell line (``mnb.train(...)``), not mnb's own (Python 3.12's ``skip_file_prefixes``, on 3.11 too)."""
    frame, level = sys._getframe(1), 1  # the function that calls warnings.warn: stacklevel 1
    while frame is not None and in_mnb(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def state(model: Any) -> dict | None:
    """What a checkpoint keeps: the settings and Megatron's ``opt_param_scheduler`` state (JSON-able)."""
    scheduler = getattr(model, "scheduler", None)
    if scheduler is None:
        return None
    return {"train_settings": dict(getattr(model, "train_settings", {})), "scheduler": scheduler.state_dict()}


def restore(model: Any, saved: dict | None, sub_optimizers: list) -> bool:
    """Rebuild the schedule :func:`state` saved, at its step; False (nothing changed) when there is none."""
    if not saved or getattr(model, "optimizer", None) is None:
        return False
    model.train_settings = dict(saved.get("train_settings") or {})
    model.scheduler = None
    tc = call_config(model, {})
    scheduler = scheduler_for(model, tc, sub_optimizers)
    scheduler.num_steps = int(saved["scheduler"]["num_steps"])
    scheduler.step(increment=0)
    return True
