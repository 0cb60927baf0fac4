"""Accept a Run, its records, or an estimate wherever a plot takes one."""

from __future__ import annotations

from typing import Any

from mnb.estimate import MemoryEstimate


def as_run(obj: Any):
    """A :class:`mnb.runs.Run` from a Run, a list of rank records, a single record or Run.to_dict()."""
    from mnb.runs import Run

    if isinstance(obj, Run):
        return obj
    if isinstance(obj, dict) and "records" in obj:
        return Run.from_dict(obj)
    if isinstance(obj, dict):
        return Run([obj])
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(r, dict) for r in obj):
        return Run(obj)
    raise TypeError(f"expected a Run or rank records, got {type(obj).__name__}")


def as_run_or_estimate(obj: Any):
    """(run, None) or (None, estimate)."""
    if isinstance(obj, MemoryEstimate):
        return None, obj
    return as_run(obj), None
