"""Plots render to PNG with Agg; counts of bars where they mean something."""

from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from test_runs import STAGE0, STAGE1, _events, make_records  # noqa: E402

import mnb.estimate as est  # noqa: E402
from mnb.config import ParallelConfig, TrainConfig  # noqa: E402
from mnb.plot import plot_memory, plot_mfu, plot_plan, plot_schedule, plot_timeline  # noqa: E402
from mnb.analysis.runs import Run, as_run  # noqa: E402


def save(ax, tmp_path, name):
    path = tmp_path / f"{name}.png"
    ax.figure.savefig(path)
    assert path.exists() and path.stat().st_size > 1000
    return path


def test_plot_memory_run(tmp_path):
    run = Run(make_records())
    ax = plot_memory(run)
    # 2 ranks x 5 predicted components + 2 measured bars
    assert len(ax.patches) == 12
    assert ax.figure.canvas.manager is None  # bare Figure outside a kernel: no pyplot state
    save(ax, tmp_path, "memory_run")
    assert run.plot_memory().figure is not None


def test_plot_memory_estimate_only(tmp_path):
    mem = est.memory("llama-7b", ParallelConfig(pp=2), TrainConfig(bf16=True, global_batch_size=64),
                     gpus=8, gpu="h200")
    ax = plot_memory(mem)
    assert len(ax.patches) == 2 * 5
    assert any("capacity" in t.get_text() for t in ax.get_legend().get_texts())
    save(ax, tmp_path, "memory_estimate")


def test_plot_memory_into_given_axes(tmp_path):
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot(111)
    assert plot_memory(as_run(make_records()), ax=ax) is ax
    save(ax, tmp_path, "memory_given")


def test_plot_timeline(tmp_path):
    run = Run(make_records())
    ax = plot_timeline(run, step=1)
    # 2 idle backgrounds + 16 compute boxes + 1 recv + 4 sync/optimizer bars
    assert len(ax.patches) == 2 + 16 + 1 + 4
    assert "step 1 of 2 drawn: idle 20.0%" in ax.get_title() and "theoretical 20.0%" in ax.get_title()
    assert sorted(t.get_text() for t in ax.texts) == sorted(str(i) for i in range(4) for _ in range(4))
    save(ax, tmp_path, "timeline")
    assert "step 2 of 2 drawn: idle 21.9%" in run.plot_timeline().get_title()  # default: last step


def test_timeline_title_and_summary_call_the_same_number_the_bubble():
    """A pp2 run of 3 steps: the title names the step it draws and, apart, the summary's bubble."""
    records = make_records()
    for rec in records:  # a third step like the first (bubble 20%): the run's median is of steps 2-3
        rank = rec["rank"]
        rec["timeline"] += _events(3, rank, STAGE0 if rank == 0 else STAGE1, 300.0)
        rec["steps"].append(dict(rec["steps"][-1], step=3))
    run = Run(records)
    assert run.measured_bubble == pytest.approx((0.21875 + 0.2) / 2)
    line = next(li for li in run.summary().splitlines() if li.startswith("bubble measured"))
    assert line.startswith("bubble measured 20.9% (median of steps 2-3) vs theoretical 20.0%"), line
    title = plot_timeline(run, step=1).get_title()
    assert title.splitlines() == [
        "step 1 of 3 drawn: idle 20.0% of this step's pipeline span",
        "run's bubble 20.9% (median of steps 2-3) vs theoretical 20.0% (tp1 pp2 dp1, m=4)"]
    assert run.plot_mfu().get_title().startswith("tiny | tp1 pp2 dp1: each of steps 1-3, MFU vs")
    assert "peak over 3 steps" in run.plot_memory().get_title()


def test_plot_schedule(tmp_path):
    ax = plot_schedule(ParallelConfig(pp=4, vpp=2, dp=1), 8)
    assert len(ax.patches) == 4 + 2 * 4 * 8 * 2
    assert "bubble 15.8%" in ax.get_title() and "formula 15.8%" in ax.get_title()  # 3 / (2 * 8 + 3)
    save(ax, tmp_path, "schedule")


def test_plot_mfu(tmp_path):
    run = Run(make_records())
    ax = plot_mfu(run)
    assert len(ax.figure.axes) == 3
    assert len(ax.lines) == 1 and len(ax.lines[0].get_xdata()) == 2
    save(ax, tmp_path, "mfu")
    cpu = Run(make_records(device="cpu", device_name="cpu"))
    save(plot_mfu(cpu), tmp_path, "mfu_cpu")
    from matplotlib.figure import Figure

    ax2 = Figure().add_subplot(111)
    assert plot_mfu(run, ax=ax2) is ax2
    assert len(ax2.figure.axes) == 3  # MFU + twin tokens/s + twin loss
    save(ax2, tmp_path, "mfu_twin")


def test_plot_plan(tmp_path):
    rows = est.plan("llama-70b", gpus=64, gpu="h200", gbs=128)
    ax = plot_plan(rows)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("fits") for label in labels)
    assert any(label.startswith("does not fit") for label in labels)
    assert any(rows[0].describe() == t.get_text() for t in ax.texts)
    save(ax, tmp_path, "plan")
    tiny = plot_plan(est.plan("tiny", gpus=2, gpu="h200"))  # megabytes on a 140 GiB device
    assert tiny.get_xlabel() == "predicted peak memory per rank (MiB)"
    assert any(t.get_text().endswith("GiB (off the axis)") for t in tiny.get_legend().get_texts())


@pytest.mark.parametrize("model, gpus, gbs", [("llama-70b", 64, 128), ("llama-8b", 8, None), ("tiny", 2, None)])
def test_plan_labels_cover_no_point_and_no_other_label(model, gpus, gbs, tmp_path):
    """%mnb plan's scatter: each label's text sits clear of every point (its own too) and of the other labels."""
    import numpy as np

    ax = plot_plan(est.plan(model, gpus=gpus, gpu="h200", gbs=gbs))
    save(ax, tmp_path, f"plan-{model}")  # drawn: the final layout
    px_per_pt = ax.figure.dpi / 72
    points = np.vstack([ax.transData.transform(c.get_offsets()) for c in ax.collections if len(c.get_offsets())])
    from matplotlib.text import Text

    boxes = [Text.get_window_extent(t) for t in ax.texts]  # the text alone (an annotation's adds its leader)
    assert len(boxes) >= min(5, len(points) // 2), [t.get_text() for t in ax.texts]
    for text, box in zip(ax.texts, boxes):
        near_x = np.clip(points[:, 0], box.x0, box.x1)
        near_y = np.clip(points[:, 1], box.y0, box.y1)
        inside = np.hypot(points[:, 0] - near_x, points[:, 1] - near_y) < 2.5 * px_per_pt  # a marker's radius
        assert not inside.any(), (text.get_text(), points[inside])
        assert ax.get_window_extent().contains(box.x0, box.y0) and ax.get_window_extent().contains(box.x1, box.y1)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)


def test_rejects_unknown_input():
    with pytest.raises(TypeError, match="expected a Run"):
        plot_memory(42)


def test_rank_records_are_turned_into_a_run_by_runs_not_by_the_plots():
    with pytest.raises(TypeError, match=r"mnb\.runs\.as_run"):
        plot_timeline(make_records())
    run = as_run(make_records())
    assert as_run(run) is run and as_run(run.to_dict()).records == run.records
    assert as_run(make_records()[0]).world_size == run.world_size


def test_plots_take_any_object_with_a_runs_fields(tmp_path):
    """Duck typing: an object that is not a Run but has its fields draws the same timeline."""
    run = Run(make_records())

    class Fields:
        def __getattr__(self, name):
            return getattr(run, name)

    ax = plot_timeline(Fields(), step=1)
    assert "idle 20.0%" in ax.get_title()
