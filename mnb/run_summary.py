"""The old import path of :mod:`mnb.analysis.run_summary` (a run's summary text).

A run's analysis lives in ``mnb/analysis/``; this module keeps ``from mnb.run_summary import ...`` working.
"""

from mnb.analysis.run_summary import summary

__all__ = ["summary"]
