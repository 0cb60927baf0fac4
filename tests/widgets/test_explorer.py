"""The explorer driven through its traits, as the page drives it, without a browser."""

from __future__ import annotations

import pytest
from traitlets import TraitError

from mnb.config import ParallelConfig, TrainConfig, load_preset
from mnb.widgets import Explorer, explorer
from mnb.widgets.choices import axis_options, candidates, check_layout, nearest
from mnb.widgets.layout_explorer import CONFIG_TRAITS


@pytest.fixture(scope="module")
def llama():
    return explorer(model="llama-8b", gpus=8, gpu="h200", bf16=True, global_batch_size=64)


def test_defaults_come_from_the_config_dataclasses():
    ex = Explorer(model="tiny", gpus=2, gpu="cpu")
    par, train, preset = ParallelConfig(), TrainConfig(), load_preset("tiny")
    assert (ex.tp, ex.pp, ex.cp, ex.ep, ex.vpp) == (par.tp, par.pp, par.cp, par.ep, 1)
    assert ex.sequence_parallel == par.sequence_parallel
    assert ex.micro_batch_size == train.micro_batch_size
    assert ex.recompute == train.recompute and ex.bf16 == train.bf16
    assert ex.use_distributed_optimizer == train.use_distributed_optimizer
    assert (ex.num_layers, ex.hidden_size, ex.num_attention_heads) == (
        preset.num_layers, preset.hidden_size, preset.num_attention_heads)
    assert ex.model_config() == preset


def test_memory_per_rank_halves_with_tp(llama):
    llama.tp = 1
    one = dict(llama.predicted["components"])
    png_one = llama.memory_png
    llama.tp = 2
    two = llama.predicted["components"]
    assert two["weights"] == pytest.approx(one["weights"] / 2, rel=0.02)
    assert two["gradients"] == pytest.approx(one["gradients"] / 2, rel=0.02)
    assert llama.predicted["peak_bytes"] < 0.75 * (sum(one.values()))
    assert llama.predicted["layout"] == "tp2 pp1 dp4"
    assert llama.memory_png != png_one and llama.memory_png.startswith(b"\x89PNG")
    assert "tp2 pp1 dp4" in llama.controls["summary"].value
    llama.tp = 1


def test_bubble_and_timeline_follow_pp(llama):
    llama.pp = 4
    m = llama.predicted["num_microbatches"]
    assert llama.predicted["layout"] == "tp1 pp4 dp2"
    assert llama.predicted["bubble"] == pytest.approx(3 / (m + 3))  # idle share of the step
    assert 2 in llama.options["vpp"]  # 32 layers / (4 * 2) and m >= pp
    png = llama.timeline_png
    llama.vpp = 2
    assert llama.predicted["bubble"] == pytest.approx(3 / (2 * m + 3))
    assert llama.timeline_png != png
    assert llama.predicted["step_time_s"] > 0 and 0 < llama.predicted["mfu"] < 1
    # the summary says where the predicted step goes (StepTimeEstimate.explain() of this layout)
    parts = dict(llama.predicted["explain"])
    assert sum(parts.values()) == pytest.approx(llama.predicted["step_time_s"])
    assert parts["pipeline bubble"] > 0 and parts["GEMM"] > parts["core attention"] > 0
    assert "where the predicted step goes" in llama.controls["summary"].value
    assert "pipeline bubble" in llama.controls["summary"].value
    llama.vpp, llama.pp = 1, 1


def test_invalid_tp_for_the_head_count_is_refused_with_a_reason():
    ex = explorer(model="tiny", gpus=8, gpu="h200")  # 4 heads, 2 query groups
    with pytest.raises(TraitError, match=r"num_attention_heads\(4\) is not divisible by tp\(8\)"):
        ex.tp = 8
    assert ex.tp == 1
    assert "8" not in [str(v) for v in ex.options["tp"]]
    assert "num_query_groups(2) is not divisible by tp(4)" in ex.unavailable["tp"]["4"]
    with pytest.raises(TraitError, match=r"does not divide world size 8"):
        ex.tp = 3


def test_unavailable_values_carry_reasons(llama):
    assert llama.options["tp"] == [1, 2, 4, 8]
    assert llama.unavailable["tp"]["3"].startswith("tp(3) * pp(1) * cp(1) = 3 does not divide world size 8")
    assert llama.options["ep"] == [1]
    assert "needs an MoE model" in llama.unavailable["ep"]["2"]
    assert "vpp(2) needs pipeline parallelism" in llama.unavailable["vpp"]["2"]
    assert "why not tp = 3, 5, 6, 7?" in llama.controls["tp_why"].value


def test_changing_gpus_or_heads_moves_the_layout_to_a_valid_value():
    ex = explorer(model="llama-8b", gpus=8, gpu="h200")
    ex.tp = 8
    ex.gpus = 4
    assert ex.tp == 4 and "tp 8 -> 4" in ex.status
    ex.num_attention_heads, ex.num_query_groups = 32, 2
    assert ex.tp == 2
    assert ex.options["tp"] == [1, 2]
    with pytest.raises(TraitError, match=r"not divisible by num_query_groups\(5\)"):
        ex.num_query_groups = 5


def test_batch_rules():
    ex = explorer(model="tiny", gpus=4, gpu="cpu", global_batch_size=8)
    with pytest.raises(TraitError, match=r"global_batch_size\(6\) is not divisible by micro_batch_size\(1\) \* dp\(4\) = 4"):
        ex.global_batch_size = 6
    ex.micro_batch_size = 4  # 8 is no multiple of 4 * 4: rounded up, and said so
    assert ex.global_batch_size == 16 and "global_batch_size 8 -> 16" in ex.status
    ex.pp = 2
    ex.global_batch_size = 8  # dp 2, mbs 4: one microbatch, too few to interleave
    assert 2 not in ex.options["vpp"]
    assert "num_microbatches(1) is not a multiple of 2" in ex.unavailable["vpp"]["2"]


def test_model_preset_loads_its_dimensions():
    ex = explorer(model="llama-8b", gpus=8, gpu="h200")
    ex.model = "tiny"
    assert (ex.num_layers, ex.hidden_size) == (4, 64)
    assert ex.predicted["peak_bytes"] < 2**30
    ex.model = "moe-tiny"
    assert 2 in ex.options["ep"]
    with pytest.raises(TraitError, match="unknown model preset"):
        ex.model = "nope"


def test_get_state_round_trip():
    ex = explorer(model="llama-8b", gpus=16, gpu="h100", tp=4, pp=2, bf16=True, global_batch_size=64,
                  recompute="selective", use_distributed_optimizer=True, sequence_parallel=True)
    state = ex.get_state()
    for name in CONFIG_TRAITS:
        assert state[name] == getattr(ex, name), name
    assert state["predicted"]["layout"] == "tp4 pp2 dp2 sp"
    other = explorer(model="tiny", gpus=2, gpu="cpu")
    other.set_state({k: state[k] for k in CONFIG_TRAITS})
    assert other.config() == ex.config()
    assert other.predicted == ex.predicted
    assert Explorer(**ex.config()).predicted == ex.predicted


def test_set_state_refuses_an_invalid_combination_as_a_whole():
    ex = explorer(model="tiny", gpus=2, gpu="cpu")
    with pytest.raises(TraitError):
        ex.set_state({"gpus": 8, "tp": 8})
    assert (ex.gpus, ex.tp) == (2, 1)


def test_controls_write_traits_and_refusals_are_put_back():
    ex = explorer(model="tiny", gpus=2, gpu="cpu")
    c = ex.controls
    assert list(c["tp"].options) == [1, 2]
    c["tp"].value = 2
    assert ex.tp == 2 and ex.predicted["layout"] == "tp2 pp1 dp1"
    c["num_attention_heads"].value = 3  # 64 % 3: refused by ModelConfig, control restored
    assert ex.num_attention_heads == 4 and c["num_attention_heads"].value == 4
    assert "refused num_attention_heads=3" in ex.status and "not divisible" in ex.status
    ex.gpus = 4
    assert c["gpus"].value == 4 and list(c["tp"].options) == [1, 2]


def test_run_on_pool_explains_why_it_cannot_run():
    ex = explorer(model="tiny", gpus=2, gpu="cpu")
    assert ex.run_on_pool(pool=None) is None or ex.status
    assert "no pool is running" in ex.pool_problem(pool=None) or "ranks" in ex.pool_problem(pool=None)


def test_choices_helpers():
    tiny = load_preset("tiny")
    assert candidates("tp", tiny, 16) == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    opts = axis_options("pp", tiny, ParallelConfig(tp=2), gpus=8)
    assert opts.valid == [1, 2, 4]
    assert "num_layers(4) is not divisible by pp(3)" in opts.unavailable[3] or "divide world size" in opts.unavailable[3]
    assert nearest(8, [1, 2, 4]) == 4 and nearest(3, [2, 4]) == 2
    with pytest.raises(ValueError, match="sequence parallel needs tp > 1"):
        check_layout(tiny, ParallelConfig(sequence_parallel=True), 2)


def test_context_parallelism_is_offered_without_transformer_engine():
    """cp runs on the local spec (mnb's all-gather attention): the explorer offers it and estimates it."""
    ex = explorer(model="llama-8b", gpus=8, gpu="h200", bf16=True, global_batch_size=8, seq_length=65536)
    assert {1, 2, 4, 8} <= set(ex.options["cp"])
    one = dict(ex.predicted["components"])
    ex.cp = 2
    assert ex.predicted["layout"] == "tp1 pp1 cp2 dp4"
    assert ex.predicted["components"]["activations"] < 0.6 * one["activations"]
    ex.seq_length = 65534  # not 4 equal chunks: cp moves to a size that splits it
    assert ex.cp == 1 and "2 * cp(2)" in ex.unavailable["cp"]["2"]


def test_the_view_shows_derived_settings_and_calls_back_without_an_explorer():
    """The view knows a Derived and two callbacks, nothing of the Explorer (its rules stay there)."""
    from mnb.widgets._explorer_view import ExplorerView, Shown
    from mnb.widgets.choices import Settings, derive

    derived = derive(Settings(model="tiny", gpus=4, gpu="cpu", tp=8))  # tp 8 moves to 2 (2 query groups)
    changes, runs = [], []
    view = ExplorerView(Shown(derived, run_steps=3), on_change=lambda n, v: changes.append((n, v)),
                        on_run=lambda: runs.append(1))
    view.sync(Shown(derived, run_steps=3))
    c = view.controls
    assert c["tp"].value == derived.settings.tp == 2 and list(c["tp"].options) == [1, 2]
    assert c["gpus"].value == 4 and c["run_steps"].value == 3
    assert "rough on CPU ranks" in c["summary"].value  # CPU predictions say they are rough
    c["tp"].value = 1
    c["run"].click()
    assert changes == [("tp", 1)] and runs == [1]
    view.sync(Shown(derived, run_steps=3))  # the owner refused it: the shown value comes back, no new call
    assert c["tp"].value == 2 and changes == [("tp", 1)]
    gpu = derive(Settings(model="tiny", gpus=8, gpu="h200"))
    view.sync(Shown(gpu, run_steps=3))
    assert not gpu.predictions.rough and "mnb-rough" not in c["summary"].value and c["gpus"].value == 8


def test_fsdp_level_shards_and_shows_its_collectives(llama):
    llama.tp, llama.pp, llama.cp = 1, 1, 1
    base = dict(llama.predicted["components"])
    assert llama.predicted["dp_collectives_bytes"].keys() == {"all_reduce"}  # DDP
    llama.fsdp = "optim_grads_params"
    zero3 = llama.predicted
    assert zero3["layout"].endswith("fsdp:optim_grads_params") and zero3["sharding"] == "optim_grads_params"
    assert zero3["components"]["gradients"] == pytest.approx(base["gradients"] / 8)
    # the bf16 and fp32 main-weight shards ((2 + 4) / 8 B per 2 B of weights), plus the gathered layers
    assert 3 * base["weights"] / 8 < zero3["components"]["weights"] < base["weights"]
    assert zero3["dp_collectives_bytes"].keys() == {"reduce_scatter", "all_gather"}
    assert llama.controls["fsdp"].value == "optim_grads_params"
    assert "all-gather" in llama.summary()
    with pytest.raises(TraitError):
        llama.fsdp = "zero3"
    with pytest.raises(TraitError, match=r"does not combine with pp\(2\)"):  # Megatron-FSDP has no pp
        llama.pp = 2
    llama.controls["fsdp"].value = None  # the page's dropdown writes the trait back
    assert llama.fsdp is None and llama.predicted["components"] == base
    llama.pp = 2
    llama.fsdp = "optim_grads"  # the explorer moves what the level rules out, saying why
    assert llama.pp == 1 and "does not combine with pp(2)" in llama.status
    llama.fsdp = None
