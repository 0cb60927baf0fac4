"""Bubble formula, warm-up counts and the schedule simulator."""

from __future__ import annotations

import pytest

import mnb.estimate as est
from mnb.config import ParallelConfig


@pytest.mark.parametrize("pp,m", [(1, 1), (2, 4), (4, 8), (8, 16), (4, 2)])
def test_bubble_1f1b(pp, m):
    """The idle share of the step: Narayanan et al.'s (p-1)/m bubble time over the step's (m+p-1) slots."""
    parallel = ParallelConfig(pp=pp, dp=1)
    assert est.bubble(parallel, m) == pytest.approx((pp - 1) / (m + pp - 1))
    assert est.bubble_time_ratio(parallel, m) == pytest.approx((pp - 1) / m)
    assert 0.0 <= est.bubble(parallel, m) < 1.0


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (8, 2, 16)])
def test_bubble_interleaved(pp, v, m):
    parallel = ParallelConfig(pp=pp, vpp=v, dp=1)
    assert est.bubble(parallel, m) == pytest.approx((pp - 1) / (v * m + pp - 1))
    assert est.bubble_time_ratio(parallel, m) == pytest.approx((pp - 1) / (v * m))


def test_bubble_falls_as_microbatches_grow():
    values = [est.bubble(ParallelConfig(pp=4, dp=1), m) for m in (1, 2, 4, 8, 16, 64)]
    assert values == sorted(values, reverse=True) and values[0] == pytest.approx(0.75)


@pytest.mark.parametrize(
    "pp,v,m", [(2, None, 4), (4, None, 8), (4, None, 3), (3, None, 5), (2, 2, 4), (4, 2, 8), (4, 2, 12), (4, 4, 8)]
)
def test_simulated_schedule_reproduces_formula(pp, v, m):
    par = ParallelConfig(pp=pp, vpp=v, dp=1)
    events = est.simulate_schedule(par, m, forward_s=1.0, backward_s=2.0)
    assert len(events) == 2 * pp * m * (v or 1)
    measured = est.timeline_bubble(events)
    if m >= pp or v:
        assert measured["bubble"] == pytest.approx(est.bubble(par, m))
    else:  # fewer microbatches than stages: the pipeline never fills
        assert measured["bubble"] >= est.bubble(par, m)


def test_warmup_counts_follow_megatron():
    assert [est.warmup_microbatches(4, r, 8) for r in range(4)] == [3, 2, 1, 0]
    assert [est.warmup_microbatches(4, r, 2) for r in range(4)] == [2, 2, 1, 0]
    # interleaved: (p - r - 1) * 2 + (v - 1) * p
    assert [est.warmup_microbatches(4, r, 8, vpp=2) for r in range(4)] == [10, 8, 6, 4]
    assert [est.in_flight(4, r, 8) for r in range(4)] == [4, 3, 2, 1]


def test_vpp_none_is_accepted_as_plain_1f1b():
    """Users may still write vpp=None (Megatron's spelling); inside mnb it is 1."""
    assert [est.warmup_microbatches(4, r, 8, vpp=None) for r in range(4)] == [3, 2, 1, 0]
    assert est.in_flight(4, 0, 8, vpp=None) == est.in_flight(4, 0, 8, vpp=1) == 4
    as_dict = est.memory("tiny", {"pp": 2, "vpp": None}, {"global_batch_size": 8}, gpus=2)
    assert as_dict.peak_bytes == est.memory("tiny", ParallelConfig(pp=2), {"global_batch_size": 8}, gpus=2).peak_bytes
    with pytest.raises(ValueError, match=r"vpp must be a positive integer \(1 = no interleaving\), got 0"):
        est.warmup_microbatches(4, 0, 8, vpp=0)


def test_bubble_errors():
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer, got 0"):
        est.bubble(ParallelConfig(pp=2, dp=1), 0)
    with pytest.raises(ValueError, match=r"num_microbatches\(2\) >= pp\(4\)"):
        est.simulate_schedule(ParallelConfig(pp=4, vpp=2, dp=1), 2)


def test_simulation_with_measured_stage_times():
    from mnb.estimate import simulate_schedule, timeline_bubble

    pp2 = ParallelConfig(pp=2)
    equal = timeline_bubble(simulate_schedule(pp2, 8, forward_s=[1.0, 1.0], backward_s=[2.0, 2.0]))["bubble"]
    assert equal == pytest.approx(1 / 9)  # (p-1)/(m+p-1) when the stages are equal
    # Stage 1 takes 1.5x as long: the steady state runs at its pace and stage 0 idles
    # 1.5 - 1 = 0.5 of its own work per microbatch on top of the fill and drain.
    slow = timeline_bubble(simulate_schedule(pp2, 8, forward_s=[1.0, 1.5], backward_s=[2.0, 3.0]))
    assert slow["by_stage"][0] > slow["by_stage"][1] and slow["bubble"] > equal
    with pytest.raises(ValueError, match=r"forward_s has 3 values for pp\(2\) stages"):
        simulate_schedule(pp2, 4, forward_s=[1, 1, 1])
