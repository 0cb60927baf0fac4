"""The old import path of :mod:`mnb.analysis.run_memory` (a run's memory beside the estimate).

A run's analysis lives in ``mnb/analysis/``; this module keeps ``from mnb.run_memory import ...`` working.
"""

from mnb.analysis.run_memory import (MEASURED_COMPONENTS, measured_memory, memory_source, peak_memory_bytes,
                                     predicted_components, predicted_memory, stage_of_rank)

__all__ = ["MEASURED_COMPONENTS", "measured_memory", "memory_source", "peak_memory_bytes", "predicted_components",
           "predicted_memory", "stage_of_rank"]
