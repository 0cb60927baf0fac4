"""Layout maths and validation messages of mnb.config."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from mnb.config import ModelConfig, ParallelConfig, TrainConfig, as_vpp, load_preset, model_config, preset_names


def megatron_coordinates(layout: ParallelConfig, world: int) -> dict[int, dict[str, int]]:
    """Coordinates from Megatron's own RankGenerator (order tp-cp-ep-dp-pp)."""
    from megatron.core.parallel_state import RankGenerator

    decoder = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order="tp-cp-ep-dp-pp")
    expert_dp = layout.dp * layout.cp // layout.ep
    expert = RankGenerator(tp=layout.tp, ep=layout.ep, dp=expert_dp, pp=layout.pp, cp=1, order="tp-cp-ep-dp-pp")
    coords: dict[int, dict[str, int]] = {r: {} for r in range(world)}
    for name, generator, token in (("tp", decoder, "tp"), ("pp", decoder, "pp"), ("dp", decoder, "dp"),
                                   ("cp", decoder, "cp"), ("ep", expert, "ep")):
        for group in generator.get_ranks(token):
            for index, rank in enumerate(group):
                coords[rank][name] = index
    return coords


@pytest.mark.parametrize("tp,pp,cp,ep", [(2, 2, 1, 1), (1, 2, 2, 1), (2, 1, 1, 2), (4, 2, 1, 1), (1, 1, 2, 4),
                                          (2, 2, 2, 1), (1, 8, 1, 1)])
def test_coordinates_match_megatrons_rank_generator(tp, pp, cp, ep):
    layout = ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep).resolve(16)
    expected = megatron_coordinates(layout, 16)
    assert {r: layout.coordinates(r) for r in range(16)} == expected


def test_layout_errors_carry_numbers():
    with pytest.raises(ValueError, match=r"tp\(2\) \* pp\(2\) \* cp\(1\) = 4 does not divide world size 6"):
        ParallelConfig(tp=2, pp=2).resolve(6)
    with pytest.raises(ValueError, match=r"ep\(4\) does not divide dp\(2\) \* cp\(1\) = 2"):
        ParallelConfig(tp=2, ep=4).resolve(4)
    with pytest.raises(ValueError, match=r"vpp\(2\) needs pipeline parallelism: pp is 1"):
        ParallelConfig(vpp=2)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        ParallelConfig(tp=0)
    assert ParallelConfig(tp=2, pp=2).resolve(8).dp == 2


def test_vpp_is_one_int_inside_mnb_and_none_is_accepted_as_1():
    """One spelling of 'no interleaving' (1); users' None becomes 1 at the boundary, below 1 is refused."""
    assert ParallelConfig().vpp == 1 and ParallelConfig(vpp=None) == ParallelConfig(vpp=1)
    assert ParallelConfig(pp=2, vpp=None).as_dict()["vpp"] == 1
    assert replace(ParallelConfig(pp=2, vpp=2), vpp=None).vpp == 1  # replace() goes through the same check
    assert ParallelConfig(**{**ParallelConfig(pp=2).as_dict(), "vpp": None}).describe() == "tp1 pp2 dp?"
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match=r"vpp must be a positive integer \(1 = no interleaving\), got"):
            ParallelConfig(pp=2, vpp=bad)
    assert [as_vpp(v) for v in (None, 1, 4)] == [1, 1, 4]


def test_model_checks_against_layout():
    tiny = load_preset("tiny")
    for parallel, message in [
        (ParallelConfig(tp=8).resolve(8), r"num_attention_heads\(4\) is not divisible by tp\(8\)"),
        (ParallelConfig(pp=3).resolve(3), r"num_layers\(4\) is not divisible by pp\(3\) \* vpp\(1\) = 3"),
        (ParallelConfig(pp=2, vpp=4).resolve(2), r"num_layers\(4\) is not divisible by pp\(2\) \* vpp\(4\) = 8"),
        (ParallelConfig(ep=2).resolve(2), r"ep\(2\) needs an MoE model"),
        (ParallelConfig(cp=2).resolve(2), None),
    ]:
        if message is None:
            tiny.check_parallel(parallel)  # seq 64 divisible by 2*cp
        else:
            with pytest.raises(ValueError, match=message):
                tiny.check_parallel(parallel)
    moe = load_preset("moe-tiny")
    with pytest.raises(ValueError, match=r"num_moe_experts\(4\) is not divisible by ep\(8\)"):
        moe.check_parallel(ParallelConfig(ep=8).resolve(8))
    odd = tiny.with_overrides(seq_length=63)
    with pytest.raises(ValueError, match=r"seq_length\(63\) is not divisible by tp\(2\) under sequence parallel"):
        odd.check_parallel(ParallelConfig(tp=2, sequence_parallel=True).resolve(2))
    with pytest.raises(ValueError, match=r"seq_length\(63\) is not divisible by 2 \* cp\(2\) = 4"):
        odd.check_parallel(ParallelConfig(cp=2).resolve(2))
    wide = tiny.with_overrides(seq_length=8, num_attention_heads=8, num_query_groups=8)
    with pytest.raises(ValueError, match=r"seq_length\(8\) / cp\(2\) = 4 tokens per cp rank are not divisible by tp\(8\)"):
        wide.check_parallel(ParallelConfig(cp=2, tp=8, sequence_parallel=True).resolve(16))


def test_batch_divisibility():
    assert TrainConfig(micro_batch_size=2, global_batch_size=16).num_microbatches(dp=2) == 4
    with pytest.raises(ValueError, match=r"global_batch_size\(12\) is not divisible by micro_batch_size\(4\) \* dp\(2\) = 8"):
        TrainConfig(micro_batch_size=4, global_batch_size=12).num_microbatches(dp=2)


def test_presets_have_known_sizes():
    assert {"tiny", "moe-tiny", "gpt2-124m", "llama-1b", "llama-3b", "llama-8b", "llama-70b"} <= set(preset_names())
    sizes = {name: load_preset(name).num_parameters() for name in ("llama-7b", "llama-8b", "llama-70b", "gpt2-124m")}
    assert sizes["llama-7b"] == pytest.approx(6.74e9, rel=0.01)
    assert sizes["llama-8b"] == pytest.approx(8.03e9, rel=0.01)
    assert sizes["llama-70b"] == pytest.approx(70.55e9, rel=0.01)
    assert sizes["gpt2-124m"] == pytest.approx(124.4e6, rel=0.01)
    with pytest.raises(ValueError, match="unknown model preset 'nope'; choose from"):
        load_preset("nope")


def test_overrides_use_megatron_names_and_pass_unknown_through():
    config = model_config("tiny", num_layers=8, hidden_dropout=0.1, seq_length=128)
    assert config.num_layers == 8 and config.extra == {"hidden_dropout": 0.1}
    assert config.max_position_embeddings >= 128
    assert isinstance(config, ModelConfig)


def test_uneven_pipeline_stages_follow_megatrons_split():
    tiny = load_preset("tiny")
    assert tiny.with_overrides(num_layers=5, num_layers_in_first_pipeline_stage=2,
                               num_layers_in_last_pipeline_stage=3).layers_per_stage(2) == [2, 3]
    assert tiny.with_overrides(num_layers=8, num_layers_in_first_pipeline_stage=2).layers_per_stage(4) == [2, 2, 2, 2]
    assert tiny.with_overrides(num_layers=6, num_layers_in_last_pipeline_stage=2).layers_per_stage(3) == [2, 2, 2]
    assert tiny.with_overrides(num_layers=4).layers_per_stage(2) == [2, 2]
    uneven = tiny.with_overrides(num_layers=5, num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=3)
    uneven.check_parallel(ParallelConfig(pp=2).resolve(2))  # Megatron accepts it, so does mnb
    with pytest.raises(ValueError, match=r"equal share of the remaining 5"):
        tiny.with_overrides(num_layers=7, num_layers_in_first_pipeline_stage=2).layers_per_stage(3)
    with pytest.raises(ValueError, match=r"num_layers\(5\) is not divisible by pp\(2\)"):
        tiny.with_overrides(num_layers=5).check_parallel(ParallelConfig(pp=2).resolve(2))


def test_the_estimate_counts_each_uneven_stages_own_layers():
    from mnb.estimate.params import stage_params

    model = load_preset("tiny").with_overrides(num_layers=4, num_layers_in_first_pipeline_stage=3,
                                               num_layers_in_last_pipeline_stage=1)
    parallel = ParallelConfig(pp=2).resolve(2)
    first, last = (stage_params(model, parallel, s) for s in (0, 1))
    assert (first.num_layers, last.num_layers) == (3, 1)
    even = [stage_params(load_preset("tiny").with_overrides(num_layers=4), parallel, s) for s in (0, 1)]
    assert first.dense > even[0].dense and last.dense < even[1].dense


def _literal_fields(cls) -> dict[str, tuple]:
    import typing

    hints = typing.get_type_hints(cls)
    return {name: typing.get_args(hint) for name, hint in hints.items() if typing.get_origin(hint) is typing.Literal}


@pytest.mark.parametrize("cls", [ModelConfig, ParallelConfig, TrainConfig])
def test_every_literal_field_refuses_a_value_outside_its_choices(cls):
    literal = _literal_fields(cls)
    assert cls is ParallelConfig or literal  # ModelConfig and TrainConfig have Literal fields
    for name, options in literal.items():
        for bad in (options[0].upper() + "x", options[0][:-1], True):
            with pytest.raises(ValueError) as caught:
                cls(**{name: bad})
            message = str(caught.value)
            assert name in message and repr(bad) in message, message
            assert all(repr(option) in message for option in options), message
        for good in options:
            assert getattr(cls(**{name: good}), name) == good
    with pytest.raises(ValueError, match=r"TrainConfig.recompute must be one of 'none', 'selective', 'full', got 'ful'"):
        TrainConfig(recompute="ful")


def test_integers_are_not_bools_and_types_are_checked():
    for cls, name in [(ParallelConfig, "tp"), (ParallelConfig, "pp"), (ParallelConfig, "cp"), (ParallelConfig, "ep"),
                      (ParallelConfig, "dp"), (TrainConfig, "steps"), (TrainConfig, "schedule_steps"),
                      (TrainConfig, "micro_batch_size"), (TrainConfig, "global_batch_size"),
                      (TrainConfig, "warmup_steps"), (TrainConfig, "seed"), (ModelConfig, "num_layers"),
                      (ModelConfig, "num_query_groups"), (ModelConfig, "ffn_hidden_size"), (ModelConfig, "rotary_base")]:
        with pytest.raises(ValueError, match=rf"{name} must be .*got True"):
            cls(**{name: True})
    for cls, name, bad in [(TrainConfig, "lr", True), (TrainConfig, "bf16", 1), (TrainConfig, "data", 3),
                           (ParallelConfig, "sequence_parallel", "yes"), (ModelConfig, "init_method_std", "0.02"),
                           (TrainConfig, "steps", 2.0)]:
        with pytest.raises(ValueError, match=rf"{cls.__name__}.{name} must be .*got {bad!r}"):
            cls(**{name: bad})
    numpy = pytest.importorskip("numpy")
    layout = ParallelConfig(tp=2, dp=numpy.int64(2))
    assert type(layout.dp) is int and layout.resolve(4).dp == 2  # numpy integers are stored as ints
    for name, bad in [("min_lr", 1.0), ("weight_decay", -0.1), ("adam_beta2", 1.0), ("schedule_steps", 0)]:
        with pytest.raises(ValueError, match=name):
            TrainConfig(lr=0.1, **{name: bad})


def test_rules_stated_once():
    from mnb.config import batch_problem, cache_dir

    # warm-up vs the schedule's length: schedule_steps when given, else steps
    with pytest.raises(ValueError, match=r"warmup_steps\(5\) must be smaller than the schedule's 5 steps"):
        TrainConfig(steps=2, schedule_steps=5, warmup_steps=5, lr_decay_style="cosine")
    later_call = TrainConfig(steps=2, warmup_steps=5, lr_decay_style="cosine")  # may continue a longer schedule
    with pytest.raises(ValueError, match=r"smaller than the schedule's 2 steps"):
        later_call.check_schedule()
    later_call.check_schedule(10)
    assert TrainConfig(steps=3, warmup_steps=3).schedule_length == 3  # constant lr: any warm-up
    # batch divisibility, with the numbers and what to use instead
    assert batch_problem(8, 2, 2) == ""
    assert batch_problem(12, 4, 2) == ("global_batch_size(12) is not divisible by micro_batch_size(4) * dp(2) = 8; "
                                       "use a multiple of 8 (e.g. 8 or 16), another micro batch size, or another layout")
    # the cache folder
    import os

    saved = {k: os.environ.pop(k, None) for k in ("MNB_CACHE", "XDG_CACHE_HOME")}
    try:
        os.environ["XDG_CACHE_HOME"] = "/x/cache"
        assert str(cache_dir()) == "/x/cache/mnb"
        os.environ["MNB_CACHE"] = "/y/mnb"
        assert str(cache_dir()) == "/y/mnb"
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    # a model dict: fields only (extra for TransformerConfig names), unknown keys named
    assert model_config({"num_layers": 3, "extra": {"hidden_dropout": 0.1}}).extra == {"hidden_dropout": 0.1}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['hiden_size'\]"):
        model_config({"num_layers": 3, "hiden_size": 64})
    assert ModelConfig.from_dict(load_preset("tiny").to_dict()) == load_preset("tiny")



def test_config_keeps_the_old_import_paths_of_what_moved_out():
    """The layout, paths, presets and the profiler's step syntax have their own modules; ``from mnb.config
    import ParallelConfig`` (and the others) still names the same object."""
    import mnb.config
    import mnb.parallel_config
    import mnb.paths
    import mnb.presets
    import mnb.profile_steps

    moved = {mnb.parallel_config: ("ParallelConfig", "as_vpp", "divisors", "FSDP_STRATEGIES", "FSDP_OPTIM_ON_CPU"),
             mnb.paths: ("cache_dir", "package_data"), mnb.presets: ("preset_names",),
             mnb.profile_steps: ("parse_steps",)}
    for module, names in moved.items():
        for name in names:
            assert getattr(mnb.config, name) is getattr(module, name), (module.__name__, name)


def test_every_config_field_is_documented_and_docs_config_md_is_generated_from_it():
    """Each field of ParallelConfig/ModelConfig/TrainConfig says what it means (every Literal choice
    named), and docs/config.md is exactly what its docstrings generate."""
    from mnb.notebook import config_reference

    assert config_reference.undocumented() == []
    assert config_reference.DOC_PATH.read_text() == config_reference.markdown(), \
        "docs/config.md is stale: run python -m mnb.config_reference --write"


def test_a_field_without_a_docstring_is_found():
    import dataclasses

    from mnb.notebook import config_reference

    @dataclasses.dataclass
    class Example:
        documented: int = 1
        """Says what it is."""
        bare: str = "x"

    assert config_reference.field_docs(Example) == {"documented": "Says what it is."}


def test_fp8_takes_the_local_recipes_and_refuses_transformer_engines_spelling():
    from mnb.config import ModelConfig, TrainConfig, model_config

    assert model_config("llama-1b", fp8="tensorwise").fp8 == "tensorwise"
    assert ModelConfig(fp8="rowwise").fp8 == "rowwise" and ModelConfig(fp8=False).fp8 is None
    assert ModelConfig(fp8="delayed").fp8 == "delayed"
    for te in (True, "hybrid", "e4m3"):
        with pytest.raises(ValueError, match=r"Transformer Engine's FP8 .*fp8='tensorwise'.*fp8='rowwise'"):
            model_config("llama-1b", fp8=te)
    with pytest.raises(ValueError, match=r"ModelConfig.fp8 must be one of 'tensorwise', 'rowwise', 'delayed' or None, got 'row'"):
        ModelConfig(fp8="row")
    with pytest.raises(ValueError, match=r"mnb.gpt\(\.\.\., fp8='rowwise'\)"):
        TrainConfig(fp8="rowwise")
    with pytest.raises(ValueError, match="covers dense models"):
        model_config("moe-tiny", fp8="tensorwise")
    assert TrainConfig(fp8=True).fp8 is True  # Transformer Engine's, where TE is installed


def test_top1_routing_and_a_sliding_window_are_refused_where_megatron_or_its_attention_would_fail():
    """moe_router_topk=1 without Megatron's pre-softmax is refused at the config (Megatron refused it inside the
    model build, naming its command-line flag); a sliding window shorter than seq_length likewise."""
    from mnb.config import ModelConfig

    with pytest.raises(ValueError, match=r"moe_router_topk=1 .*no gradient.*moe_router_pre_softmax=True"):
        ModelConfig(num_moe_experts=4, moe_router_topk=1)
    assert ModelConfig(num_moe_experts=4, moe_router_topk=1, extra={"moe_router_pre_softmax": True}).moe_router_topk == 1
    with pytest.raises(ValueError, match=r"seq_length\(128\) exceeds sliding_window\(64\).*pass seq_length<=64"):
        ModelConfig(sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig(sliding_window=0, seq_length=1)
    assert ModelConfig(sliding_window=128).sliding_window == 128


def test_the_interleaved_schedule_takes_a_multiple_of_pp_microbatches_everywhere_it_is_checked():
    """Megatron-Core's interleaved 1F1B runs microbatches in groups of pp and refuses a short last group: 3
    microbatches on pp 2 failed inside the schedule, while the plan ranked such layouts first and %%megatron
    let them run.  The rule is one function; the plan, the cell check and the estimators use it."""
    from mnb import estimate
    from mnb.config import TrainConfig, interleave_problem
    from mnb.controller.preflight import check_cell

    assert interleave_problem(4, 2, 2) == "" and interleave_problem(3, 2, 1) == ""
    assert "num_microbatches(3) is not a multiple of 2" in interleave_problem(3, 2, 2, 1)
    assert "use global_batch_size 2 or 4" in interleave_problem(3, 2, 2, 1)
    assert "num_microbatches(1) is not a multiple of 2" in interleave_problem(1, 2, 2)
    rows = list(estimate.plan("llama-8b", gpus=8, train=TrainConfig(global_batch_size=20, micro_batch_size=1, bf16=True)))
    interleaved = [r for r in rows if r.parallel.vpp > 1]
    assert interleaved and all(r.num_microbatches % r.parallel.pp == 0 for r in interleaved)
    cell = "m = mnb.gpt('tiny')\nmnb.train(m, steps=2, micro_batch_size=1, global_batch_size=3)"
    problems = check_cell(cell, ParallelConfig(pp=2, vpp=2, dp=1))
    assert len(problems) == 1 and "num_microbatches(3) is not a multiple of 2" in problems[0], problems
    assert check_cell(cell.replace("=3", "=4"), ParallelConfig(pp=2, vpp=2, dp=1)) == []
    with pytest.raises(ValueError, match="not a multiple of 2"):
        estimate.memory("tiny", ParallelConfig(pp=2, vpp=2), TrainConfig(micro_batch_size=1, global_batch_size=3), gpus=2)


def test_unknown_train_settings_are_refused_before_the_cell_runs_by_the_ranks_rule():
    """mnb.train(model, bogus=1) is refused by the %%megatron check with the ranks' own message (one rule), also for
    a non-literal value; the extras the rule lets through are exactly mnb.train's own non-field arguments."""
    import inspect

    from mnb.config import TRAIN_CALL_EXTRAS, TrainConfig, train_settings_problem
    from mnb.controller.preflight import check_cell
    from mnb.megatron.train import train

    problems = check_cell("m = mnb.gpt('tiny')\nmnb.train(m, steps=2, bogus_kw=x)", ParallelConfig(dp=2))
    assert problems == ["mnb.train(...): " + train_settings_problem(["steps", "bogus_kw"])], problems
    assert "train() got unknown settings ['bogus_kw']; valid: [" in problems[0]
    assert check_cell("m = mnb.gpt('tiny')\nmnb.train(m, steps=2, profile=p, seq_length=64)", ParallelConfig(dp=2)) == []
    own = set(inspect.signature(train).parameters) - {"model", "fields"} - set(TrainConfig.__dataclass_fields__)
    assert own == set(TRAIN_CALL_EXTRAS)
