"""Adopt what a torchrun script does at start-up that a live pool rank has already done.

A script written for ``torchrun --nproc-per-node N script.py`` creates the default
process group, picks its GPU and builds Megatron's parallel state.  In a pool rank
the group exists and must outlive the script, so inside :func:`adopted` (used by
``%mnb run``, :mod:`mnb.worker.script`):

- ``torch.distributed.init_process_group(...)`` returns when the request matches
  the pool (world size, rank, a backend the pool runs: on CPU ranks ``nccl`` runs
  on the pool's gloo); a mismatch raises a ValueError that says what to change.  A
  script run on some ranks only (``--ranks``) cannot join the whole world: the call
  raises at once instead of hanging in the first collective.
- ``torch.distributed.destroy_process_group()`` of the default group does nothing
  (other groups are destroyed as asked: Megatron destroys its gloo groups so);
  a later ``init_process_group`` adopts the pool's group again.
- On CPU ranks ``new_group(backend="nccl")`` gets the default (gloo) backend.
- Megatron's parallel state starts uninitialised, as under torchrun (Megatron-LM's
  ``initialize_megatron`` skips ``initialize_model_parallel`` when it finds one), so
  the models mnb built in earlier cells are released; the script's
  ``initialize_model_parallel`` reuses the pool's cached communicators
  (:mod:`mnb.megatron.layout`); afterwards the pool's layout is rebuilt (:func:`restore`).

``set_device``, ``.cuda()`` and ``device="cuda"`` in the script follow the CPU
redirection of :mod:`mnb.megatron.cpu` (bound by the script runner).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mnb.errors import ScriptGroupError

logger = logging.getLogger(__name__)


class _Adoption:
    def __init__(self, ranks: list[int], cpu_ranks: bool) -> None:
        self.ranks = sorted(ranks)
        self.cpu_ranks = cpu_ranks
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.joined = False
        self.original = {
            "init": dist.init_process_group, "destroy": dist.destroy_process_group, "new_group": dist.new_group,
        }

    def init_process_group(self, backend: Any = None, init_method: Any = None, timeout: Any = None,
                           world_size: int = -1, rank: int = -1, *args: Any, **kwargs: Any) -> None:
        """Adopted ``init_process_group``: the pool's default group, when it matches."""
        if len(self.ranks) != self.world:
            raise ScriptGroupError(
                f"the script calls torch.distributed.init_process_group, which needs every rank of the "
                f"pool ({self.world}), but it runs on rank(s) {self.ranks} only (--ranks): drop --ranks, "
                "or run only scripts that use no process group on a subset of ranks")
        if world_size not in (None, -1) and int(world_size) != self.world:
            raise ScriptGroupError(
                f"init_process_group(world_size={world_size}) but the pool has {self.world} ranks: start a "
                f"pool of that size (%mnb start -n {world_size}) or pass WORLD_SIZE from the environment")
        if rank not in (None, -1) and int(rank) != self.rank:
            raise ScriptGroupError(
                f"init_process_group(rank={rank}) on pool rank {self.rank}: take the rank from the "
                "environment (RANK), as torchrun sets it")
        running = str(dist.get_backend()).lower()
        wanted = str(backend).lower() if backend else ""
        if wanted and running not in wanted and not (self.cpu_ranks and "nccl" in wanted):
            raise ScriptGroupError(
                f"init_process_group(backend={backend!r}) but the pool's ranks run {running!r}: "
                f"use backend={running!r} (or none), or start the pool on the device that backend needs")
        if self.joined:
            raise ValueError("trying to initialize the default process group twice!")  # torch's own words
        self.joined = True
        logger.info("init_process_group(%r) adopted: the pool's %s group of %d", backend, running, self.world)

    def destroy_process_group(self, group: Any = None) -> None:
        """Adopted ``destroy_process_group``: the default group stays (the pool needs it)."""
        if group is None or group is c10d.GroupMember.WORLD:
            self.joined = False
            return
        self.original["destroy"](group)

    def new_group(self, *args: Any, **kwargs: Any):
        if self.cpu_ranks and "nccl" in str(kwargs.get("backend") or "").lower():
            kwargs["backend"] = None  # the default group's backend: gloo
        return self.original["new_group"](*args, **kwargs)


def _set(name: str, value: Any) -> None:
    for module in (dist, c10d):
        setattr(module, name, value)


@contextlib.contextmanager
def _parallel_state_for_script(ranks: list[int], world: int) -> Iterator[None]:
    """Megatron's parallel state as a fresh torchrun process has it (none); the pool's afterwards."""
    from megatron.core import parallel_state as ps

    from mnb.megatron import layout

    pool_layout = layout.current_layout()
    whole_world = len(ranks) == world
    if whole_world and ps.model_parallel_is_initialized():
        import sys

        model_module = sys.modules.get("mnb.megatron.model")
        if model_module is not None:
            model_module.release_all("a script (%mnb run) replaced Megatron's parallel state; "
                                     "build the model again in a cell after it")
        ps.destroy_model_parallel()
    original = ps.initialize_model_parallel

    def initialize_model_parallel(*args: Any, **kwargs: Any):
        if not whole_world:
            raise ScriptGroupError(f"initialize_model_parallel needs every rank of the pool ({world}); "
                                   f"the script runs on rank(s) {ranks} only (--ranks): drop --ranks")
        with layout._reuse_groups():  # the pool's communicators for rank sets it already has
            return original(*args, **kwargs)

    ps.initialize_model_parallel = initialize_model_parallel
    try:
        yield
    finally:
        ps.initialize_model_parallel = original
        if whole_world and pool_layout is not None:
            _pending.append(pool_layout)


_pending: list = []
"""The pool's layout, to rebuild after a script (:func:`restore`)."""


def restore() -> bool:
    """Rebuild the pool's layout after a script; True if there was one to rebuild.

    Not done when the script ends: rebuilding runs collectives, and a rank whose script
    failed would wait in them for ranks still inside the script (the root cause would
    never be reported).  The pool asks for it in a request of its own, once every rank
    is idle again (``Pool.run_script``).
    """
    from megatron.core import parallel_state as ps

    from mnb.megatron import layout

    if not _pending:
        return False
    pool_layout = _pending.pop()
    _pending.clear()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    layout.apply_layout(pool_layout)  # not initialised any more: rebuilt and seeded
    return True


def _fresh_megatron_training_globals() -> None:
    """Megatron-LM's globals (args, tokenizer, timers, the rerun state machine) start unset, as in a
    fresh torchrun process.

    ``megatron.training`` (shipped with megatron-core 0.19) refuses to set its args twice
    ("args is already initialized"), so a second ``%mnb run`` of a ``pretrain()`` script
    would fail where a second ``torchrun`` would not.
    """
    import sys

    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is not None and hasattr(global_vars, "unset_global_variables"):
        global_vars.unset_global_variables()
    rerun = sys.modules.get("megatron.core.rerun_state_machine")  # initialize_megatron sets it once too
    if rerun is not None and hasattr(rerun, "destroy_rerun_state_machine"):
        rerun.destroy_rerun_state_machine()


@contextlib.contextmanager
def _fresh_rng_tracker() -> Iterator[None]:
    """Megatron's CUDA RNG tracker unset while the script runs, as in a fresh process.

    The pool uses the inference tracker kind on CPU ranks (``layout.seed_ranks``); a script's
    ``model_parallel_cuda_manual_seed(seed)`` would keep that kind (Megatron creates the
    tracker once) and draw differently from a fresh process.  The pool's tracker is back after.
    """
    from megatron.core.tensor_parallel import random as mrandom

    saved = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = None, False
    try:
        yield
    finally:
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved


@contextlib.contextmanager
def adopted(*, ranks: list[int], cpu_ranks: bool) -> Iterator[_Adoption]:
    """While the block runs, the script's start-up calls adopt the pool's state (module doc)."""
    if not dist.is_initialized():
        raise RuntimeError("adopted() runs in pool ranks, whose default process group exists")
    adoption = _Adoption(ranks, cpu_ranks)
    _fresh_megatron_training_globals()
    with _parallel_state_for_script(adoption.ranks, adoption.world), _fresh_rng_tracker():
        _set("init_process_group", adoption.init_process_group)
        _set("destroy_process_group", adoption.destroy_process_group)
        _set("new_group", adoption.new_group)
        try:
            yield adoption
        finally:
            _set("init_process_group", adoption.original["init"])
            _set("destroy_process_group", adoption.original["destroy"])
            _set("new_group", adoption.original["new_group"])
            if torch.cuda.is_available() and not cpu_ranks:
                torch.cuda.synchronize()
