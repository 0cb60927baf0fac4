"""mnb.runs.Run on synthetic records (see tests/runs_fixtures.py for the hand-written timeline)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from runs_fixtures import make_records  # noqa: E402

from mnb.config import ParallelConfig  # noqa: E402
from mnb.estimate import MemoryEstimate  # noqa: E402
from mnb.runs import Run  # noqa: E402


def test_losses_times_and_layout():
    run = Run(make_records())
    assert run.steps == [1, 2]
    assert run.losses == [5.5, 5.0]  # only the last stage reports a loss
    assert run.step_times_s == [17.0, 18.0]  # slowest rank
    assert run.tokens_per_s == pytest.approx([256 / 17, 256 / 18])  # as recorded (min over ranks)
    assert run.layout == ParallelConfig(tp=1, pp=2, dp=1)
    assert run.model.name == "tiny" and run.train.global_batch_size == 4
    assert sorted(run.ranks) == [0, 1]
    assert run.peak_memory_bytes == {0: 2_000_000, 1: 2_000_001}


def test_measured_bubble_from_timeline():
    run = Run(make_records())
    assert run.measured_bubble_per_step == pytest.approx({1: 0.25, 2: 0.28})
    assert run.measured_bubble == pytest.approx(0.28)  # first step left out
    assert run.theoretical_bubble == pytest.approx(0.25)
    events = run.timeline(1)
    assert {e["stage"] for e in events} == {0, 1}
    assert all(e["step"] == 1 for e in events)


def test_mfu_uses_device_peak():
    run = Run(make_records())
    assert run.mfu == pytest.approx([1e12 / (17.0 * 2 * 989e12), 1e12 / (18.0 * 2 * 989e12)])
    cpu = Run(make_records(device="cpu", device_name="cpu"))
    assert cpu.mfu == [None, None]
    assert "MFU n/a" in cpu.summary()
    given = Run(make_records(device="cpu", device_name="cpu"), peak_flops=1e12)
    assert given.mfu == pytest.approx([1 / 34, 1 / 36])
    assert Run(make_records(device="cpu", device_name="cpu"), gpu="cpu").mfu[0] > 0


def test_predicted_memory_and_summary():
    run = Run(make_records())
    pred = run.predicted_memory
    assert isinstance(pred, MemoryEstimate) and len(pred.stages) == 2
    assert pred.capacity_bytes == 150_000_000_000
    text = run.summary()
    for piece in ("tiny", "tp1 pp2 dp1", "loss 5.5000 -> 5.0000", "MFU", "bubble measured 28.0% vs theoretical 25.0%",
                  "peak memory", "vs predicted"):
        assert piece in text, (piece, text)
    assert "<b>mnb run</b>" in run._repr_html_()
    assert repr(run).startswith("<Run tiny")


def test_json_round_trip():
    run = Run(make_records(), peak_flops=5e14)
    back = Run.from_dict(json.loads(json.dumps(run.to_dict())))
    assert back.losses == run.losses
    assert back.mfu == run.mfu
    assert back.measured_bubble == pytest.approx(run.measured_bubble)
    assert back.to_dict() == run.to_dict()


def test_tolerates_missing_optional_keys():
    recs = make_records()
    for r in recs:
        for key in ("timeline", "memory", "model_flops_per_step", "num_microbatches", "coords"):
            r.pop(key)
    run = Run(recs)
    assert run.measured_bubble is None
    assert run.peak_memory_bytes == {0: 2_000_000, 1: 2_000_001}  # from the per-step peaks
    assert run.num_microbatches == 4
    assert run.mfu[0] > 0  # FLOPs from mnb.estimate
    assert "loss" in run.summary()
    with pytest.raises(ValueError, match="at least one rank record"):
        Run([])
