"""mnb: drive Megatron-Core on a live pool of torchrun ranks from Jupyter.

Notebook side::

    %load_ext mnb
    %mnb start -n 2 --device cpu
    %%megatron --tp 2
    model = mnb.gpt("tiny")
    run = mnb.train(model, steps=20, data="stdlib")

Everything here is imported lazily: ``import mnb`` in the notebook kernel
pulls in neither torch nor Megatron.  ``mnb.gpt``, ``mnb.train``, ``mnb.record``,
``mnb.save``, ``mnb.load``, ``mnb.from_hf``, ``mnb.logits``, ``mnb.save_hf``, ``mnb.generate``,
``mnb.evaluate`` and LoRA's ``mnb.lora``, ``mnb.merge_lora``, ``mnb.save_adapter``, ``mnb.load_adapter`` are rank-side functions (they need torch and run inside
``%%megatron`` cells); ``mnb.pool``, ``mnb.last_run``, ``mnb.estimate``,
``mnb.explorer``, ``mnb.sweep``, ``mnb.hf_config`` and ``mnb.export`` (Megatron-LM / torchrun / Slurm
launches of the notebook's layout) belong to the notebook side.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "__version__",
    "load_ipython_extension",
    "unload_ipython_extension",
    "pool",
    "last_run",
    "last_profile",
    "estimate",
    "gpt",
    "train",
    "record",
    "save",
    "load",
    "generate",
    "evaluate",
    "explorer",
    "sweep",
    "export",
    "from_hf",
    "logits",
    "save_hf",
    "hf_config",
    "lora",
    "merge_lora",
    "save_adapter",
    "load_adapter",
    "ParallelConfig",
    "ModelConfig",
    "TrainConfig",
    "RankError",
    "CompositeRankError",
]

# name -> (module, attribute); attribute None means the module itself.
_LAZY = {
    "pool": ("mnb.controller", "pool"),
    "estimate": ("mnb.estimate", None),
    "gpt": ("mnb.megatron.model", "gpt"),
    "train": ("mnb.megatron.train", "train"),
    "record": ("mnb.megatron.autorecord", "record"),
    "save": ("mnb.megatron.checkpoint", "save"),
    "load": ("mnb.megatron.checkpoint", "load"),
    "generate": ("mnb.megatron.generate", "generate"),
    "evaluate": ("mnb.megatron.evaluate", "evaluate"),
    "explorer": ("mnb.widgets", "explorer"),
    "sweep": ("mnb.widgets", "sweep"),
    "export": ("mnb.megatron_lm.exports", "export"),
    "from_hf": ("mnb.megatron.hf", "from_hf"),
    "logits": ("mnb.megatron.logits", "logits"),
    "save_hf": ("mnb.megatron.hf", "save_hf"),
    "hf_config": ("mnb.hf_config", "hf_config"),
    "lora": ("mnb.megatron.lora", "lora"),
    "merge_lora": ("mnb.megatron.lora", "merge_lora"),
    "save_adapter": ("mnb.megatron.hf.adapters", "save_adapter"),
    "load_adapter": ("mnb.megatron.hf.adapters", "load_adapter"),
    "ParallelConfig": ("mnb.config", "ParallelConfig"),
    "ModelConfig": ("mnb.config", "ModelConfig"),
    "TrainConfig": ("mnb.config", "TrainConfig"),
    "RankError": ("mnb.errors", "RankError"),
    "CompositeRankError": ("mnb.errors", "CompositeRankError"),
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        # In mnb.version, so that modules below this one can name it too.
        from mnb.version import __version__

        return __version__
    if name == "last_run":
        # Kept by the controller; None until a training cell has finished.
        from mnb.controller import last_run

        return last_run()
    if name == "last_profile":
        # The notebook's last profiled cell (mnb.notebook.profiles.Profile); None until one ran.
        from mnb.notebook.profiles import last_profile

        return last_profile()
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'mnb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext mnb``: register ``%mnb`` and ``%%megatron``, and bind ``mnb`` in the notebook.

    ``mnb`` is bound (hidden from ``%who``, like ``get_ipython``) unless the
    notebook already has that name, so ``mnb.last_run`` works without
    ``import mnb``.  Loading again registers the same magics again: silent.
    On a machine with GPUs it also begins standby ranks for the first ``%mnb start``
    (``mnb/controller/load_standby.py``; ``MNB_STANDBY_AT_LOAD=0`` turns that off).
    """
    import sys

    from mnb.controller import current_pool
    from mnb.controller import load_standby
    from mnb.notebook.magics import register

    register(ipython)
    from mnb import notices

    notices.route(_to_pool_log, kernel_warnings=True)  # torchao's, torch's, transformers' known notices
    if "mnb" not in ipython.user_ns:
        ipython.push({"mnb": sys.modules[__name__]}, interactive=False)
    existing = current_pool(required=False)
    if load_standby.begin(pool_running=existing is not None and existing.running):
        print(f"mnb: launching standby ranks for the first %mnb start ({load_standby.AT_LOAD_ENV}=0 "
              "turns this off)", flush=True)


def _to_pool_log(line: str) -> None:
    """A known third-party notice (:mod:`mnb.notices`) raised in the kernel: to the running pool's log
    (``mnb.pool().spec.log_file``, beside the ranks' own), else to mnb's logger at debug level."""
    import logging

    from mnb.controller import current_pool

    pool = current_pool(required=False)
    log_file = getattr(getattr(pool, "spec", None), "log_file", None)
    if log_file is not None:
        try:
            with open(log_file, "a", encoding="utf-8") as f:
                f.write("mnb kernel (to the log): " + line)
            return
        except OSError:
            pass
    logging.getLogger("mnb").debug("known notice: %s", line.rstrip())


def unload_ipython_extension(ipython: Any) -> None:
    from mnb.controller import standby
    from mnb.notebook.magics import unregister

    unregister(ipython)
    parked = standby.unpark()  # the load-time or a stopped pool's standby: nothing would adopt it now
    if parked is not None:
        parked.close()
