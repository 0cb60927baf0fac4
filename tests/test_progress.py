"""The one progress payload: counted once, from 1, and read the same way everywhere."""

from __future__ import annotations

import doctest

import mnb.progress
from mnb.progress import Progress


def test_doctests():
    assert doctest.testmod(mnb.progress).failed == 0


def test_the_last_event_of_a_call_reads_steps_of_steps_never_one_more():
    last = Progress.from_payload({"step": 5, "steps": 5, "global_step": 14, "loss": 2.0, "extra": "ignored"})
    assert last.short() == "step 5/5" and last.finished
    assert last.line().startswith("step 5/5 [" + "#" * 30 + "]")
    first = Progress.from_payload({"step": 1, "steps": 5})
    assert first.short() == "step 1/5" and not first.finished and first.loss is None


def test_missing_fields_default_and_an_unknown_total_still_reads():
    progress = Progress.from_payload({})
    assert progress.short() == "step 0" and not progress.finished
    assert Progress.from_payload({"step": 3, "steps": None}).short() == "step 3"
