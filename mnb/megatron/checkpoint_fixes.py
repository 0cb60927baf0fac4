"""Workarounds for megatron-core bugs that mnb's checkpoints hit, kept apart from the save/load logic.

Each says where the bug is; each applies only when the bug shows (checked on 0.16.1).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def cuda_calls_on_cpu() -> Iterator[None]:
    """Let dist_checkpointing save on CPU ranks that did not call mnb.megatron.cpu.install().

    megatron-core 0.16.1 calls CUDA during a torch_dist save even when every
    tensor is on the CPU (found by running the save on a CPU-only torch):

    - ``dist_checkpointing/strategies/filesystem_async.py:230``,
      ``FileSystemWriterAsync.preload_tensors``: ``torch.cuda.synchronize()``
      (``non_blocking=True`` is hard-wired by the caller at line 207);
    - ``dist_checkpointing/strategies/state_dict_saver.py:252``,
      ``save_state_dict_async_finalize``:
      ``torch.tensor(..., device=torch.cuda.current_device())``.

    ``cpu.install()`` redirects both (its torch proxy); this is only the fallback,
    active for the duration of one save/load, when CUDA is absent and CPU mode
    is not installed.
    """
    try:
        from mnb.megatron import cpu

        installed = cpu.installed()
    except ImportError:
        installed = False
    if torch.cuda.is_available() or installed:
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def init_empty_optimizer_state(optimizer) -> None:
    """Give a never-stepped DistributedOptimizer its Adam state (zeros) before loading.

    Without Apex/TE, megatron-core 0.16's ``DistributedOptimizer.state_dict()``
    (distrib_optimizer.py:642, called by ``sharded_state_dict(is_loading=True)``)
    reads the per-parameter Adam ``step`` and asserts there is exactly one; a fresh
    optimizer has none. Megatron's own dummy-state helper (a zero-gradient step:
    no parameter changes) fills it; the checkpoint then overwrites it.
    """
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        init = getattr(sub, "_init_optimizer_states_with_dummy_values", None)
        inner = getattr(sub, "optimizer", None)
        if callable(init) and inner is not None and not inner.state:
            init()


@contextlib.contextmanager
def torch_adam_step_fixes(optimizer) -> Iterator[None]:
    """Work around two bugs of megatron-core 0.16.1's DistributedOptimizer with torch Adam.

    Both hit the DistributedOptimizer without Apex/TE (so CPU ranks, and GPUs without TE):

    1. ``load_parameter_state_from_fully_reshardable`` (distrib_optimizer.py:2101)
       skips Adam's ``step`` when it builds the source tensors, but
       ``_set_main_param_and_optimizer_states`` (distrib_optimizer.py:938) copies
       every destination key, ``step`` included: ``KeyError: 'step'``. During the
       load a missing ``step`` is filled with the current one (``load_state_dict``
       has already restored it from the param groups).
    2. ``DistributedOptimizer.load_state_dict`` (distrib_optimizer.py:821-825) puts
       *one* ``step`` tensor into every parameter's state; torch Adam increments it
       in place once per parameter, so after a load the bias correction runs ahead
       (next-but-one loss off by ~4e-3 on the tiny preset). Each state gets its own
       copy after the load.
    """
    patched = []
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for sub in subs:
        original = getattr(sub, "_set_main_param_and_optimizer_states", None)
        config = getattr(sub, "config", None)
        if original is None or getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            continue

        def fill_step(model_param, tensors, sub=sub, original=original):
            if "step" not in tensors:
                group, order = sub.model_param_group_index_map[model_param]
                state = sub.optimizer.state[sub.optimizer.param_groups[group]["params"][order]]
                if "step" in state:
                    tensors = {**tensors, "step": state["step"].clone()}
            return original(model_param, tensors)

        sub._set_main_param_and_optimizer_states = fill_step
        patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states
    for sub in subs:
        inner = getattr(sub, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
