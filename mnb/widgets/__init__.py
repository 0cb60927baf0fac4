"""Notebook widgets: the parallelism explorer, layout sweeps and live training progress.

    import mnb
    mnb.explorer(model="llama-8b", gpus=8, gpu="h200")          # predictions, live as you move sliders
    result = mnb.sweep({"tp": [1, 2], "pp": [1, 2]}, steps=3)   # measured on the running pool
    from mnb.widgets.live import attach; attach(mnb.pool())     # %mnb start does this

Notebook side only (ipywidgets + matplotlib; never torch).  Submodules load
on first use so ``import mnb.widgets`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Explorer", "SweepResult", "explorer", "sweep"]


def explorer(model: str = "llama-8b", gpus: int = 8, gpu: str = "h200", **settings: Any):
    """The parallelism explorer (:class:`mnb.widgets.layout_explorer.Explorer`)."""
    from .layout_explorer import explorer as make

    return make(model=model, gpus=gpus, gpu=gpu, **settings)


def sweep(layouts: Any, **kwargs: Any):
    """Run layouts on the pool in turn; see :func:`mnb.widgets.layout_sweep.sweep`."""
    from .layout_sweep import sweep as run

    return run(layouts, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Explorer":
        from .layout_explorer import Explorer

        return Explorer
    if name == "SweepResult":
        from .sweep_result import SweepResult

        return SweepResult
    raise AttributeError(f"module 'mnb.widgets' has no attribute {name!r}")
