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
    with pytest.raises(ValueError, match=r"num_microbatches\(2\) is not a multiple of 4"):
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


def test_uneven_end_stages_interleave_through_megatrons_pipeline_layout():
    """Megatron-Core's num_layers_in_first/last_pipeline_stage need a multiple of vpp layers; its
    pipeline_model_parallel_layout places any count.  mnb writes the layout, reads it as
    Megatron-Core's own parser does, and the estimators take it (with the interleaved bubble)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from mnb.config import ModelConfig, TrainConfig, parse_pipeline_layout, uneven_pipeline_layout

    letters = {"embedding": "E", "decoder": "t", "loss": "L"}
    for layers, pp, vpp, first, last in [(126, 16, 2, 7, 7), (126, 16, 3, 7, 7), (30, 4, 2, 9, None),
                                         (15, 4, 2, None, 3), (16, 4, 4, 5, 3)]:
        text = uneven_pipeline_layout(layers, pp, vpp, first=first, last=last)
        theirs = PipelineParallelLayerLayout(text, pp)
        theirs.validate_layer_layout(num_layers=layers, mtp_num_layers=None)
        assert theirs.virtual_pipeline_model_parallel_size == vpp
        ours = parse_pipeline_layout(text, pp)
        assert [[ours[c * pp + r] for c in range(vpp)] for r in range(pp)] == [
            ["".join(letters[t.name] for t in chunk) for chunk in rank] for rank in theirs.layout], text
        model = ModelConfig(name="m", num_layers=layers, hidden_size=64, num_attention_heads=4, vocab_size=256,
                            extra={"pipeline_model_parallel_layout": text})
        per_rank = model.layers_per_stage(pp, vpp)
        assert per_rank[0] == (first or per_rank[1]) and per_rank[-1] == (last or per_rank[1]) and sum(per_rank) == layers
        assert [sum(c) for c in model.layers_per_virtual_stage(pp, vpp)] == per_rank
        model.check_parallel(ParallelConfig(pp=pp, vpp=vpp, dp=1))

    assert uneven_pipeline_layout(126, 16, 2, first=7, last=7) == "Ettt|,(tttt|)*30,tttL"
    llama = ModelConfig(name="m", num_layers=126, hidden_size=64, num_attention_heads=4, vocab_size=256,
                        extra={"num_layers_in_first_pipeline_stage": 7, "num_layers_in_last_pipeline_stage": 7})
    with pytest.raises(ValueError, match=r"multiple of vpp layers.*pipeline_model_parallel_layout="
                                         r"'Ettt\|,\(tttt\|\)\*30,tttL'"):
        llama.check_parallel(ParallelConfig(pp=16, vpp=2, dp=1))
    laid = llama.with_overrides(num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                                pipeline_model_parallel_layout="Ettt|,(tttt|)*30,tttL")
    with pytest.raises(ValueError, match=r"32 virtual stages = pp\(16\) x 2, and vpp is 1: set vpp=2"):
        laid.check_parallel(ParallelConfig(pp=16, dp=1))
    with pytest.raises(ValueError, match=r"has 125 decoder layers \('t'\), the model num_layers\(126\)"):
        laid.with_overrides(pipeline_model_parallel_layout="Ett|,(tttt|)*30,tttL").layers_per_stage(16)
    with pytest.raises(ValueError, match="the embedding E must open the first virtual stage"):
        parse_pipeline_layout("tE|tL", 2)
    with pytest.raises(ValueError, match=r"has \['x'\]; its letters are E \(embedding\)"):
        parse_pipeline_layout("Ex|tL", 2)
    with pytest.raises(ValueError, match=r"3 virtual stages, not a multiple of pp\(2\)"):
        parse_pipeline_layout("Et|t|tL", 2)
    with pytest.raises(ValueError, match="cannot be set with num_layers_in_first/last"):
        laid.with_overrides(num_layers_in_first_pipeline_stage=7).layers_per_stage(16)
    # the interleaved bubble: vpp 2 halves the fill and drain of 1F1B with the same stages
    train = TrainConfig(bf16=True, global_batch_size=32)
    plain = llama.with_overrides(num_layers=30, num_layers_in_first_pipeline_stage=9,
                                 num_layers_in_last_pipeline_stage=None)
    interleaved = plain.with_overrides(num_layers_in_first_pipeline_stage=None,
                                       pipeline_model_parallel_layout=uneven_pipeline_layout(30, 4, 2, first=9))
    one = est.step_time(plain, ParallelConfig(pp=4, dp=1), train, gpu="h100")
    two = est.step_time(interleaved, ParallelConfig(pp=4, vpp=2, dp=1), train, gpu="h100")
    assert two.compute_s == pytest.approx(one.compute_s) and two.bubble_s == pytest.approx(one.bubble_s / 2)
