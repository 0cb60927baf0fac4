"""The old import path of :mod:`mnb.analysis.runs` (a training's run records).

A run's analysis lives in ``mnb/analysis/``; this module keeps ``from mnb.runs import ...`` working.
"""

from mnb.analysis.runs import as_run, MEASURED_COMPONENTS, Run

__all__ = ["as_run", "MEASURED_COMPONENTS", "Run"]
