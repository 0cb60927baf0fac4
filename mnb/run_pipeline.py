"""The old import path of :mod:`mnb.analysis.run_pipeline` (a run's pipeline timeline and bubbles).

A run's analysis lives in ``mnb/analysis/``; this module keeps ``from mnb.run_pipeline import ...`` working.
"""

from mnb.analysis.run_pipeline import (expected_bubble, measured_bubble, measured_bubble_by_stage,
                                       measured_bubble_per_step, theoretical_bubble, timeline, timeline_steps)

__all__ = ["expected_bubble", "measured_bubble", "measured_bubble_by_stage", "measured_bubble_per_step",
           "theoretical_bubble", "timeline", "timeline_steps"]
