"""Per-microbatch timeline (mnb.megatron.timing) from real pipeline runs and in isolation."""

import time

import pytest
from conftest import ok

from mnb.megatron.timing import TimelineRecorder, schedule_table


def one_f_one_b(stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    """Expected compute order of 1F1B on one stage (Narayanan et al. 2021)."""
    warmup = min(stages - stage - 1, m)
    order = [("forward", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("forward", warmup + i), ("backward", i)]
    order += [("backward", i) for i in range(m - warmup, m)]
    return order


def _steps(record):
    return sorted({row["step"] for row in record["timeline"]})


@pytest.mark.slow
def test_pp2_four_microbatches_in_1f1b_order(world2):
    for stage, rank in enumerate(world2):
        record = ok(rank["pp2"])
        assert record["coords"]["pp"] == stage and record["num_microbatches"] == 4
        assert len(_steps(record)) == 10
        for step in _steps(record):
            rows = [r for r in record["timeline"] if r["step"] == step]
            compute = [(r["kind"], r["microbatch"]) for r in rows if r["kind"] in ("forward", "backward")]
            assert compute == one_f_one_b(stage, 2, 4)
            assert all(r["stage"] == stage and r["chunk"] == 0 for r in rows)
            assert all(0 <= r["start_s"] <= r["end_s"] for r in rows)
            starts = [r["start_s"] for r in rows if r["kind"] in ("forward", "backward")]
            assert starts == sorted(starts)
            kinds = {r["kind"] for r in rows}
            assert "optimizer" in kinds and "all-grads-sync" in kinds
            assert kinds & {"forward-send", "forward-recv", "backward-send", "backward-recv",
                            "forward-send-backward-recv", "backward-send-forward-recv"}


@pytest.mark.slow
def test_interleaved_rows_carry_chunk_and_microbatch(world2):
    for rank in world2:
        record = ok(rank["pp2-vpp2"])
        rows = [r for r in record["timeline"] if r["step"] == 1]
        forward = [(r["microbatch"], r["chunk"]) for r in rows if r["kind"] == "forward"]
        backward = [(r["microbatch"], r["chunk"]) for r in rows if r["kind"] == "backward"]
        table = schedule_table(4, 2, 2)
        assert forward == table
        assert backward == [(mb, 1 - chunk) for mb, chunk in table]


def test_schedule_table_matches_megatron():
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    for m, v, g in [(4, 2, 2), (8, 2, 4), (6, 3, 2), (5, 2, 2), (3, 2, 4)]:
        assert schedule_table(m, v, g) == [tuple(x) for x in get_schedule_table(m, v, g)]


def test_recorder_assigns_microbatches_by_call_order():
    rec = TimelineRecorder(stage=1, num_microbatches=2)
    rec.begin_step(7)
    for name in ("forward-compute", "backward-compute", "forward-compute", "backward-compute"):
        rec(name, log_level=2).start()
        time.sleep(0.001)
        rec(name).stop()
    rec("forward-backward").start()
    rec("forward-backward").stop()
    with rec.span("optimizer"):
        pass
    rows = rec.end_step()
    assert [(r["kind"], r["microbatch"]) for r in rows] == [
        ("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1), ("optimizer", None)]
    assert all(r["step"] == 7 and r["stage"] == 1 for r in rows)
    assert rows[0]["end_s"] - rows[0]["start_s"] >= 0.001
