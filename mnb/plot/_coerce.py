"""What a plot takes: any object with a run's fields (e.g. :class:`mnb.analysis.runs.Run`), or an estimate.

Plots read data, not classes: nothing here imports :mod:`mnb.analysis.runs`.  Turning rank records
or ``Run.to_dict()`` into a run is :func:`mnb.analysis.runs.as_run`'s job, done by the caller.
"""

from __future__ import annotations

from typing import Any, Iterable

from mnb.estimate import MemoryEstimate

RUN_FIELDS = ("layout", "model", "steps")
"""Fields every plot of a run reads; each plot names the others it needs."""


def as_run(obj: Any, needs: Iterable[str] = ()) -> Any:
    """``obj`` itself when it has a run's fields (``RUN_FIELDS`` and ``needs``); else TypeError."""
    missing = [name for name in (*RUN_FIELDS, *needs) if not hasattr(obj, name)]
    if not missing:
        return obj
    hint = ""
    if isinstance(obj, (dict, list, tuple)):
        hint = "; for rank records or Run.to_dict() pass mnb.runs.as_run(obj)"
    raise TypeError(f"expected a Run (or an object with its fields; missing {missing}), "
                    f"got {type(obj).__name__}{hint}")


def as_run_or_estimate(obj: Any, needs: Iterable[str] = ()) -> tuple[Any, MemoryEstimate | None]:
    """(run, None) or (None, estimate)."""
    if isinstance(obj, MemoryEstimate):
        return None, obj
    return as_run(obj, needs), None


def step_span(steps: list[int]) -> str:
    """'steps 4-6' / 'step 4': a run's step numbers as titles name them (``run.steps``, from 1)."""
    if not steps:
        return "no step"
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
