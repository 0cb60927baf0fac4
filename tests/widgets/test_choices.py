"""derive() and refusal(): the explorer's rules as pure functions, tested without any widget."""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import replace

import pytest

from mnb.config import load_preset
from mnb.widgets.choices import AXES, CONFIG_TRAITS, MODEL_DIMS, Settings, derive, refusal


def test_valid_settings_come_back_unchanged_with_their_predictions():
    s = Settings(model="llama-8b", gpus=8, tp=2, pp=2, bf16=True, global_batch_size=64)
    d = derive(s)
    assert d.settings == s.with_preset_dims() and d.adjustments == () and d.error == ""
    assert d.options["tp"].valid == [1, 2, 4] and "world size 8" in d.options["tp"].unavailable[8]
    p = d.predictions.as_dict()
    assert p["layout"] == "tp2 pp2 dp2" and p["num_microbatches"] == 32 and p["global_batch_size"] == 64
    assert p["bubble"] == pytest.approx(1 / 33) and p["peak_bytes"] == d.predictions.memory.peak_bytes
    assert p["peak_source"] == "NVIDIA H200 SXM 141GB datasheet peak"


def test_an_invalid_combination_is_adjusted_and_the_reason_reported():
    """tp 8 on 4 GPUs: tp moves to the nearest size that divides the world, and the line says why."""
    d = derive(Settings(model="llama-8b", gpus=4, tp=8, bf16=True))
    assert d.settings.tp == 4
    assert d.adjustments == ("tp 8 -> 4: tp(8) * pp(1) * cp(1) = 8 does not divide world size 4; "
                             "choose sizes whose product divides 4",)
    assert d.predictions.as_dict()["layout"] == "tp4 pp1 dp1"


def test_each_kind_of_adjustment_names_its_rule():
    heads = derive(Settings(model="llama-8b", gpus=8, tp=8, num_query_groups=2))
    assert heads.settings.tp == 2 and heads.adjustments == (
        "tp 8 -> 2: num_query_groups(2) is not divisible by tp(8); choose tp from [1, 2]",)
    batch = derive(Settings(model="tiny", gpus=4, gpu="cpu", micro_batch_size=4, global_batch_size=8))
    assert batch.settings.global_batch_size == 16 and batch.adjustments == (
        "global_batch_size 8 -> 16: a multiple of micro_batch_size(4) * dp(4) = 16",)
    few = derive(Settings(model="tiny", gpus=4, gpu="cpu", pp=2, vpp=2, micro_batch_size=4, global_batch_size=8))
    assert (few.settings.pp, few.settings.vpp) == (2, 1) and few.adjustments == (
        "vpp 2 -> 1: the interleaved pipeline schedule (vpp=2) runs microbatches in groups of pp(2), and "
        "num_microbatches(1) is not a multiple of 2 (Megatron-Core refuses it); use global_batch_size 16 or 32, "
        "or another layout",)
    sp = derive(Settings(model="tiny", gpus=2, gpu="cpu", sequence_parallel=True))
    assert sp.settings.sequence_parallel is False and sp.adjustments == ()  # off with tp 1, as Megatron has it


def test_the_size_that_cannot_stay_is_the_one_that_moves():
    """A size no value of which fits the others as they are waits for the others (it is not forced to 1)."""
    world = derive(Settings(model="llama-8b", gpus=6, pp=4, vpp=2, global_batch_size=48))  # was 8 GPUs
    assert (world.settings.tp, world.settings.pp, world.settings.vpp) == (1, 2, 2)
    assert world.adjustments == ("pp 4 -> 2: tp(1) * pp(4) * cp(1) = 4 does not divide world size 6; "
                                 "choose sizes whose product divides 6",)
    layers = derive(Settings(model="llama-8b", gpus=8, pp=4, vpp=3, global_batch_size=64))  # 32 layers, not 36
    assert (layers.settings.pp, layers.settings.vpp) == (4, 2)
    assert layers.adjustments == ("vpp 3 -> 2: num_layers(32) is not divisible by pp(4) * vpp(3) = 12",)
    both = derive(Settings(model="llama-8b", gpus=6, tp=4, pp=4, global_batch_size=48))  # no one size fixes it
    assert (both.settings.tp, both.settings.pp) == (1, 2) and both.adjustments == (
        "tp 4 -> 1: tp(4) * pp(4) * cp(1) = 16 does not divide world size 6; choose sizes whose product divides 6",
        "pp 4 -> 2: tp(1) * pp(4) * cp(1) = 4 does not divide world size 6; choose sizes whose product divides 6")


def test_settings_that_cannot_be_estimated_say_why():
    d = derive(Settings(model="tiny", num_attention_heads=3))  # 64 % 3
    assert d.predictions is None and "not divisible" in d.error and d.options == {}


def test_a_new_model_brings_its_dimensions_unless_they_changed_with_it():
    shown = derive(Settings(model="llama-8b", gpus=8)).settings
    switched = derive(replace(shown, model="tiny"), previous=shown).settings
    assert (switched.num_layers, switched.hidden_size) == (4, 64)
    tiny = load_preset("tiny")
    restored = derive(replace(shown, model="tiny", num_layers=8), previous=shown).settings  # a whole state
    assert (restored.num_layers, restored.hidden_size) == (8, shown.hidden_size) != (tiny.num_layers, tiny.hidden_size)
    assert derive(replace(shown, model="tiny")).settings.hidden_size == shown.hidden_size  # no previous: as given


def test_the_measured_cpu_peak_is_what_mfu_is_against():
    s = Settings(model="tiny", gpus=2, gpu="cpu")
    assert "nominal CPU peak" in derive(s).predictions.peak_source
    measured = derive(s, cpu_peak_flops=5e10).predictions
    assert measured.peak_source == "measured CPU peak 50 GFLOP/s per rank"
    assert measured.step_time.mfu > derive(s).predictions.step_time.mfu  # the same FLOPs against a lower peak


def test_every_layout_settles_and_its_answer_is_a_fixed_point():
    for model, gpus, tp, pp, vpp, cp, ep in itertools.product(
            ["tiny", "moe-tiny", "llama-8b"], [1, 3, 4, 6, 8], [1, 2, 8], [1, 2, 4], [1, 3], [1, 2], [1, 4]):
        s = Settings(model=model, gpus=gpus, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, gpu="cpu", global_batch_size=8)
        d = derive(s)
        assert all(getattr(d.settings, a) in d.options[a].valid for a in AXES), (s, d.settings)
        assert d.predictions is not None, (s, d.error)
        again = derive(d.settings)
        assert again.settings == d.settings and again.adjustments == (), (s, again.adjustments)


def test_refusal_names_the_rule_a_typed_value_breaks():
    s = Settings(model="tiny", gpus=8, gpu="h200").with_preset_dims()
    assert refusal(s, "tp", 8) == "num_attention_heads(4) is not divisible by tp(8); choose tp from [1, 2, 4]"
    assert refusal(s, "tp", 3).startswith("tp(3) * pp(1) * cp(1) = 3 does not divide world size 8")
    assert refusal(s, "tp", 2) == "" and refusal(s, "gpus", 3) == ""  # the layout follows a new GPU count
    assert refusal(s, "gpus", 0) == "gpus must be at least 1, got 0"
    assert "not divisible by num_query_groups(3)" in refusal(s, "num_query_groups", 3)
    assert refusal(s, "global_batch_size", 6) == (  # mnb.config.batch_problem, the rule training applies
        "global_batch_size(6) is not divisible by micro_batch_size(1) * dp(8) = 8; use a multiple of 8 "
        "(e.g. 8 or 16), another micro batch size, or another layout")
    assert refusal(s, "model", "nope").startswith("unknown model preset 'nope'")
    assert refusal(s, "vpp", 2).startswith("vpp(2) needs pipeline parallelism: pp is 1")


def test_settings_are_the_explorers_traits_and_need_no_widgets():
    assert CONFIG_TRAITS[:1 + len(MODEL_DIMS)] == ("model", *MODEL_DIMS)
    assert {"gpu", "gpus", *AXES, "sequence_parallel", "global_batch_size"} <= set(CONFIG_TRAITS)
    assert not any(name.split(".")[0] in ("ipywidgets", "traitlets") for name in _imported_by("mnb.widgets.choices"))


def _imported_by(module: str) -> list[str]:
    """Modules a fresh interpreter holds after importing ``module``."""
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.split()
