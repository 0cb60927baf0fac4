"""(Re)initialise Megatron's parallel layout inside live ranks.

The worker initialises ``torch.distributed`` once; every ``%%megatron --tp 2``
cell then calls :func:`apply_layout`, which rebuilds Megatron's process groups
only when the requested layout differs from the current one::

    from mnb.config import ParallelConfig
    from mnb.megatron.layout import apply_layout, coordinates
    apply_layout(ParallelConfig(tp=2))   # True: groups rebuilt
    apply_layout(ParallelConfig(tp=2))   # False: nothing to do
    coordinates()                        # {'tp': 1, 'pp': 0, 'dp': 0, 'cp': 0, 'ep': 0}

Models built under one layout are not valid under another: build them again
after a layout change (``mnb.gpt`` checks this).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from typing import Any

import torch

from mnb.config import ParallelConfig

logger = logging.getLogger(__name__)

_current: ParallelConfig | None = None
_generation = 0
"""Increments on every re-initialisation; models remember the one they were built under."""


def _parallel_state():
    from megatron.core import parallel_state

    return parallel_state


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def current_layout() -> ParallelConfig | None:
    """The layout Megatron's groups were last built for (dp filled in), or None."""
    if _current is None or not _parallel_state().model_parallel_is_initialized():
        return None
    return _current


def generation() -> int:
    """A counter that changes whenever the process groups are rebuilt."""
    return _generation


def megatron_vpp(vpp: int) -> int | None:
    """Megatron's spelling of mnb's ``vpp`` (an int >= 1): ``None`` when there is no interleaving."""
    return vpp if vpp > 1 else None


def _same_groups(a: ParallelConfig, b: ParallelConfig) -> bool:
    """True when a and b need the same process groups (sequence_parallel and fsdp are model flags)."""
    return dataclasses.replace(a, sequence_parallel=False, fsdp=None) == dataclasses.replace(
        b, sequence_parallel=False, fsdp=None
    )


def _call_megatron(fn, **kwargs):
    """Call Megatron's ``fn`` with every keyword argument, refusing by name one it does not take.

    Dropping an unaccepted argument would change what runs without a word (an unaccepted
    ``expert_model_parallel_size`` would be ep=1), so a megatron-core outside the supported range
    fails here, before any group is built, naming the argument and the version."""
    params = inspect.signature(fn).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        from importlib.metadata import version

        raise TypeError(f"{fn.__module__}.{fn.__qualname__} of megatron-core {version('megatron-core')} takes no "
                        f"{', '.join(unknown)}: mnb supports megatron-core>=0.16,<0.20")
    return fn(**kwargs)


_before_change: list = []
"""Callbacks ``fn(old, new)`` run before the groups of ``old`` are destroyed (model.py
releases the models built for them)."""


def on_layout_change(callback) -> None:
    """Register ``callback(old_layout, new_layout)``, called before a layout change."""
    if callback not in _before_change:
        _before_change.append(callback)


_group_cache: dict[tuple, Any] = {}
"""Process groups by (ranks, backend, options): reused when a later layout asks for the same
ranks, so a live pool holds one communicator per distinct rank set however often it re-lays out."""


@contextlib.contextmanager
def _reuse_groups():
    """Make ``torch.distributed.new_group`` return the cached group for a rank set seen before.

    megatron-core (checked 0.16.1 and 0.19.2) forgets its groups on
    ``destroy_model_parallel`` and destroys only its explicit *gloo* groups; the
    NCCL communicators stay alive with their buffers, so every re-layout of a live
    pool leaked GPU memory.  Destroying them instead costs seconds per re-layout on
    NCCL; reusing them makes switching back to a layout nearly free.  Explicit gloo
    groups are not cached because Megatron destroys those itself.  Every rank takes
    the same cache decisions in the same order, so the collective ``new_group``
    calls stay matched.
    """
    original = torch.distributed.new_group

    def cached_new_group(ranks=None, timeout=None, backend=None, pg_options=None, **kwargs):
        if backend == "gloo" or ranks is None:
            return original(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options, **kwargs)
        key = (tuple(sorted(ranks)), backend, repr(pg_options), repr(timeout),
               kwargs.get("use_local_synchronization", False))
        if key not in _group_cache:
            _group_cache[key] = original(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                                         **kwargs)
        return _group_cache[key]

    torch.distributed.new_group = cached_new_group
    try:
        yield
    finally:
        torch.distributed.new_group = original


def apply_layout(parallel: ParallelConfig, *, seed: int = 1234) -> bool:
    """Make Megatron's process groups match ``parallel``; True if they were rebuilt.

    Needs ``torch.distributed`` initialised (the worker does it).  dp is
    resolved from the world size; a mismatch raises ValueError naming the sizes.
    """
    global _current, _generation
    if not _initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: apply_layout runs inside pool ranks "
            "(start a pool with %mnb start), or call torch.distributed.init_process_group first"
        )
    resolved = parallel.resolve(torch.distributed.get_world_size())
    now = current_layout()
    if now is not None and _same_groups(now, resolved):
        _current = resolved
        return False
    ps = _parallel_state()
    if ps.model_parallel_is_initialized():
        for callback in list(_before_change):
            callback(now, resolved)
        _current = None  # from here until the new groups exist this rank has no layout, and says so
        ps.destroy_model_parallel()
    with _reuse_groups():
        _call_megatron(
            ps.initialize_model_parallel,
            tensor_model_parallel_size=resolved.tp,
            pipeline_model_parallel_size=resolved.pp,
            virtual_pipeline_model_parallel_size=megatron_vpp(resolved.vpp),
            context_parallel_size=resolved.cp,
            expert_model_parallel_size=resolved.ep,
        )
    seed_ranks(seed)
    _current = resolved
    _generation += 1
    logger.info(
        "layout %s (rank %d of %d)",
        resolved.describe(),
        torch.distributed.get_rank(),
        torch.distributed.get_world_size(),
    )
    return True


def seed_ranks(seed: int) -> None:
    """Seed torch and Megatron's RNG tracker for the current layout (CPU-safe)."""
    from megatron.core import tensor_parallel

    from mnb.megatron import cpu

    torch.manual_seed(seed)
    _call_megatron(
        tensor_parallel.model_parallel_cuda_manual_seed,
        seed=seed,
        # On CPU the tracker cannot swap CUDA generator states; the inference
        # tracker's fork() is a no-op and everything draws from the CPU generator.
        inference_rng_tracker=cpu.installed() or not torch.cuda.is_available(),
        force_reset_rng=True,
    )


def coordinates() -> dict[str, int]:
    """This rank's index in each parallel group; zeros before any layout."""
    if current_layout() is None:
        return {"tp": 0, "pp": 0, "dp": 0, "cp": 0, "ep": 0}
    ps = _parallel_state()
    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
    }


def require_layout() -> ParallelConfig:
    """The current layout, or a RuntimeError saying how to set one."""
    layout = current_layout()
    if layout is None:
        raise RuntimeError(
            "no parallel layout is initialised on this rank: run the cell under "
            "%%megatron --tp/--pp/... or call mnb.megatron.layout.apply_layout(ParallelConfig(...))"
        )
    return layout
