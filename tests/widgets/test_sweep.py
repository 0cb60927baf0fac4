"""Sweeps and the explorer's measured run on a real 2-rank CPU pool (tiny model, few steps)."""

from __future__ import annotations

import _thread
import threading
import time

import pytest

from mnb.config import ParallelConfig
from mnb.widgets import explorer, sweep
from mnb.widgets.layout_sweep import expand
from mnb.widgets.sweep_result import SweepResult, SweepRow, pareto_front

pytestmark = pytest.mark.slow


def test_sweep_of_layouts_collects_measurements_and_failures(cpu_pool, capsys):
    result = sweep({"tp": [1, 2], "pp": [1, 2]}, steps=3, model="tiny", global_batch_size=8, pool=cpu_pool)
    extra = sweep([{"pp": 2, "vpp": 2}, {"cp": 2}, {"tp": 1, "micro_batch_size": 3}, {"fsdp": "optim_grads_params"},
                   {"pp": 2, "fsdp": "optim"}], steps=3, model="tiny", global_batch_size=8, pool=cpu_pool)
    by_label = {r.label: r for r in result.rows + extra.rows}
    ran = [r for r in result.rows + extra.rows if r.ok]
    # cp runs without Transformer Engine too (mnb's all-gather attention)
    assert {r.label for r in ran} == {"tp1 pp1 dp2", "tp1 pp2 dp1", "tp2 pp1 dp1", "tp1 pp2 vpp2 dp1", "tp1 pp1 cp2 dp1",
                                      "tp1 pp1 dp2 fsdp:optim_grads_params"}  # ZeRO-3 (Megatron-FSDP)
    for row in ran:
        assert row.peak_memory_bytes > 0 and row.tokens_per_s > 0 and row.step_time_s > 0
        assert 0 < row.mfu < 1  # CPU: against the ranks' measured GEMM peak
        assert row.bubble is not None and row.theoretical_bubble is not None
    assert by_label["tp1 pp2 dp1"].theoretical_bubble == pytest.approx(1 / 9)  # (p-1)/(m+p-1), m = 8
    invalid = by_label["tp2 pp2 dp?"]
    assert invalid.status == "invalid" and "does not divide world size 2" in invalid.reason
    no_pp = by_label["pp=2, fsdp=optim"]  # refused before any rank is touched
    assert no_pp.status == "invalid" and "does not combine with pp(2)" in no_pp.reason
    batch = by_label["tp1 pp1 dp2 mbs3"]
    assert batch.status == "invalid" and "global_batch_size(8) is not divisible" in batch.reason

    assert result.throughput == "mfu"  # CPU ranks measure their GEMM peak, so MFU ranks the layouts
    assert result.pareto() and all(r.ok for r in result.pareto())
    text = result.table()
    assert "tp2 pp2 dp?" in text and "invalid" in text and "3 of 4 layouts ran" in text
    html = result._repr_html_()
    assert "<table>" in html and "data:image/png;base64," in html
    ax = result.plot()
    assert "MFU" in ax.get_ylabel()
    printed = capsys.readouterr().out
    assert "[1/4] tp1 pp1 dp2: ok" in printed  # plain-text progress outside a notebook
    print("\n" + text + "\n" + extra.table())  # the measured table, for the record (pytest -s)


def test_a_layout_failing_on_the_ranks_is_an_error_row_and_the_next_layouts_still_run(cpu_pool):
    """fp8 passes the notebook-side checks but every CPU rank refuses it inside mnb.train."""
    restarts = cpu_pool.restarts
    result = sweep([{"tp": 2}, {"pp": 2, "fp8": True}, {"pp": 2}], steps=2, model="tiny", global_batch_size=8,
                   pool=cpu_pool, show=False)
    before, failed, after = result.rows
    assert failed.label == "tp1 pp2 dp1 fp8" and failed.status == "error"
    assert failed.reason.startswith("rank 0,1: ValueError: fp8=True is Transformer Engine's FP8 and needs TE"), failed.reason
    assert failed.peak_memory_bytes is None and failed.tokens_per_s is None
    assert before.ok and after.ok and after.label == "tp1 pp2 dp1" and after.tokens_per_s > 0
    assert cpu_pool.restarts == restarts  # a rank exception needs no restart: the same ranks ran the next layout
    assert "2 of 3 layouts ran" in result.table() and "fp8=True is Transformer Engine's FP8" in result.table()


def test_keyboard_interrupt_stops_the_sweep_and_returns_the_partial_result(cpu_pool):
    timer = threading.Timer(2.5, _thread.interrupt_main)
    timer.start()
    try:
        result = sweep([{"tp": 1}, {"pp": 2}, {"tp": 2}], steps=100, model="tiny", global_batch_size=8,
                       pool=cpu_pool, show=False)
    finally:
        timer.cancel()
    assert result.interrupted
    statuses = [r.status for r in result.rows]
    assert "interrupted" in statuses and statuses[-1] in ("skipped", "interrupted")
    assert "partial result" in result.table()
    interrupted = next(r for r in result.rows if r.status == "interrupted")
    assert interrupted.reason.startswith("stopped by the user (")
    # No restart by hand: the interrupt stops mnb.train at a step boundary on every rank
    # (or the pool replaces ranks it could not release), so the next request just works.
    assert cpu_pool.run("rank + 1") == {0: 1, 1: 2}


def test_explorer_runs_on_the_pool_in_the_background(cpu_pool):
    from mnb.controller import registry

    registry._CPU_PEAK.clear()  # as in a fresh kernel: no CPU training has measured the ranks' peak yet
    ex = explorer(model="tiny", gpus=2, gpu="cpu", pp=2, global_batch_size=8, run_steps=4)
    assert "nominal CPU peak" in ex.predicted["peak_source"]
    predicted_png = ex.memory_png
    t0 = time.perf_counter()
    thread = ex.run_on_pool(cpu_pool)
    returned_s = time.perf_counter() - t0
    assert thread is not None and returned_s < 0.5  # the kernel is not blocked
    assert ex.running and ex.controls["run"].disabled
    assert "already in progress" in ex.pool_problem(cpu_pool)
    ex.wait(120)
    assert not ex.running, ex.status
    m = ex.measured
    assert m["layout"] == "tp1 pp2 dp1" and m["steps"] == 4
    assert m["peak_memory_bytes"] > 0 and m["tokens_per_s"] > 0 and 0 < m["mfu"] < 1
    assert m["theoretical_bubble"] == pytest.approx(ex.predicted["bubble"])
    assert ex.memory_png != predicted_png
    assert "measured" in ex.controls["summary"].value
    assert "measured CPU peak" in ex.predicted["peak_source"]  # the run measured it: the predictions beside use it
    assert "measured CPU peak" in ex.controls["summary"].value
    ex.pp = 1  # a new setting drops the stale measurement
    assert ex.measured == {}
    assert "measured CPU peak" in ex.predicted["peak_source"]  # and later predictions too
    assert ex.predicted["rough"].startswith("rough on CPU ranks")  # and say they are rough
    assert "rough on CPU ranks" in ex.summary() and "mnb-rough" in ex.controls["summary"].value
    ex.gpus = 4
    assert "set gpus to 2" in ex.pool_problem(cpu_pool)
    assert ex.run_on_pool(cpu_pool) is None and "pool has 2 ranks" in ex.status


def _row(i, mem, tps, status="ok"):
    return SweepRow(index=i, label=f"l{i}", settings={}, status=status, peak_memory_bytes=mem, tokens_per_s=tps)


def test_pareto_front_and_table_without_a_pool():
    rows = [_row(0, 1.0, 10.0), _row(1, 2.0, 20.0), _row(2, 2.0, 15.0), _row(3, 3.0, 19.0),
            _row(4, None, None, "oom")]
    assert [r.index for r in pareto_front(rows, "tokens_per_s")] == [0, 1]
    result = SweepResult(rows, model="tiny", steps=3, world_size=2, device="cpu")
    assert result.best().index == 1
    assert "oom" in result.table()
    assert result.as_dicts()[4]["status"] == "oom"


def test_expand_grids_and_layouts():
    points = expand({"tp": [1, 2], "micro_batch_size": [1, 2]})
    assert points == [{"tp": 1, "micro_batch_size": 1}, {"tp": 1, "micro_batch_size": 2},
                      {"tp": 2, "micro_batch_size": 1}, {"tp": 2, "micro_batch_size": 2}]
    assert expand([ParallelConfig(tp=2, sequence_parallel=True)]) == [{"tp": 2, "sequence_parallel": True}]
    with pytest.raises(ValueError, match="unknown sweep field"):
        expand({"tpp": [1]})
    with pytest.raises(ValueError, match="grid values must be lists"):
        expand({"tp": 2})
