"""Layout planner recommendations and the no-torch import contract."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mnb.estimate as est
from mnb.units import format_bytes, format_seconds


def test_llama7b_on_8_h200_prefers_data_parallel():
    rows = est.plan("llama-7b", gpus=8, gpu="h200", seq=4096, mbs=1, gbs=128)
    best = rows[0]
    assert best.fits
    assert (best.parallel.tp, best.parallel.pp, best.parallel.dp) == (1, 1, 8)
    assert best.use_distributed_optimizer and best.recompute == "none"
    assert rows.best is best
    for r in rows:
        p = r.parallel
        assert p.tp * p.pp * p.cp * p.dp == 8
        assert p.sequence_parallel == (p.tp > 1)
        assert r.use_distributed_optimizer == (p.dp * p.cp > 1)  # Megatron shards over dp x cp
    fits = [r.fits for r in rows]
    assert fits == sorted(fits, reverse=True)
    assert "tp1 pp1 dp8" in est.format_plan(rows[:3]) and "HFU" in est.format_plan(rows[:3])
    assert "GiB" in est.format_plan(rows[:3]) and " s " in est.format_plan(rows[:3])
    full = next(r for r in rows if r.recompute == "full")
    assert full.hfu == pytest.approx(full.time_estimate.hfu) and full.hfu > full.mfu  # recompute counted


def test_llama70b_on_64_needs_model_parallelism():
    rows = est.plan("llama-70b", gpus=64, gpu="h200", seq=4096, mbs=1, gbs=128)
    best = rows[0]
    assert best.fits and best.parallel.tp * best.parallel.pp > 1
    # without model parallelism only ZeRO-3 (parameters sharded over the 64 ranks) fits
    replicated = [r for r in rows if r.parallel.tp * r.parallel.pp == 1]
    assert all(not r.fits for r in replicated if r.parallel.fsdp != "optim_grads_params")
    assert any(r.fits for r in replicated if r.parallel.fsdp == "optim_grads_params")


def test_moe_plan_includes_expert_parallel():
    rows = est.plan("mixtral-8x7b", gpus=8, gpu="h200", mbs=1, gbs=64)
    assert any(r.parallel.ep > 1 for r in rows)
    assert rows[0].fits


def test_plan_takes_none_for_no_interleaving():
    old, new = (est.plan("llama-7b", gpus=8, gpu="h200", mbs=1, gbs=64, vpps=v) for v in ((None, 2), (1, 2)))
    assert [(r.parallel, r.recompute) for r in old] == [(r.parallel, r.recompute) for r in new]
    assert {r.parallel.vpp for r in new} == {1, 2}


def test_plan_errors():
    with pytest.raises(ValueError, match="gpus must be a positive integer, got 0"):
        est.plan("tiny", gpus=0)
    with pytest.raises(ValueError, match=r"no valid layout for tiny on 3 GPUs with gbs\(4\)"):
        est.plan("tiny", gpus=3, gbs=4)
    with pytest.raises(ValueError, match=r"gbs\(3\) is not divisible by mbs\(2\)"):
        est.plan("tiny", gpus=2, mbs=2, gbs=3)


def test_step_time_parts():
    from mnb.config import ParallelConfig, TrainConfig

    train = TrainConfig(bf16=True, global_batch_size=128, use_distributed_optimizer=True)
    t = est.step_time("llama-7b", ParallelConfig(pp=2), train, gpus=8, gpu="h200", achievable_fraction=0.5)
    assert t.compute_s == pytest.approx(est.flops("llama-7b", train, causal=True) / (8 * 989e12 * 0.5))
    assert t.bubble_s == pytest.approx(t.compute_s * 1 / 32)  # (p-1)/m with m = 128/4
    assert t.tp_comm_s == 0 and t.dp_comm_s > 0 and t.pp_comm_s > 0
    assert 0 < t.mfu < 0.6  # model FLOPs count the full s*s matrix; executed work is causal


def test_notebook_modules_import_no_torch():
    code = (
        "import sys, mnb, mnb.estimate, mnb.analysis.runs, mnb.plot\n"
        "bad = [m for m in ('torch', 'megatron', 'numpy') if m in sys.modules]\n"
        "print(bad)\n"
        "assert not [m for m in bad if m != 'numpy'], bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torch" not in out.stdout


def test_long_sequences_are_offered_context_parallelism():
    """cp runs without TE (mnb's all-gather attention), so the plan offers it by default."""
    rows = est.plan("llama-8b", gpus=8, gpu="h200", seq=65536, mbs=1, gbs=8)
    with_cp = [r for r in rows if r.parallel.cp > 1]
    assert {r.parallel.cp for r in with_cp} == {2, 4, 8}
    assert any(r.fits for r in with_cp)
    # cp divides the activations of the sequence; the whole sequence's K/V stays per layer.
    from mnb.config import load_preset

    long = load_preset("llama-8b").with_overrides(seq_length=65536)
    cp1 = est.memory(long, {"tp": 2, "dp": 4, "sequence_parallel": True},
                     {"bf16": True, "global_batch_size": 8}, fused_loss=True).stages[0]
    cp2 = next(r for r in rows if (r.parallel.tp, r.parallel.cp, r.recompute) == (2, 2, "none"))
    assert cp2.memory_estimate.stages[0].activations_bytes < 0.6 * cp1.activations_bytes
    with pytest.raises(ValueError, match=r"no valid layout"):
        est.plan("tiny", gpus=2, seq=6, cps=[2], tps=[1], pps=[1])  # 6 tokens are not 4 equal chunks


def test_a_tiny_models_plan_shows_its_memory_and_step_time_in_units_that_say_something():
    rows = est.plan("tiny", gpus=2, gpu="h200")
    text, html = est.format_plan(rows[:4]), rows._repr_html_()
    assert "0.0 GiB" not in text and "0.000" not in text and " 0 s" not in text
    best = rows[0]
    assert 2**20 <= best.memory_bytes < 2**30 and 1e-6 <= best.step_time_s < 1e-3  # what the units must carry
    line = text.splitlines()[1]
    assert format_bytes(best.memory_bytes) in line and format_seconds(best.step_time_s) in line
    assert f"<td>{format_seconds(best.step_time_s)}</td>" in html and "MiB</td>" in html


def test_the_plan_interleaves_a_model_whose_end_stages_are_uneven():
    """126 layers (Llama 3 405B's count) split 7, 8 x 14, 7: the planner once skipped pp 16 (126 % 16)
    and every vpp > 1 (126 % 32); with Megatron-Core's pipeline_model_parallel_layout it plans both."""
    from mnb.config import load_preset, uneven_pipeline_layout

    base = load_preset("llama-70b").with_overrides(num_layers=126, seq_length=2048)
    laid = base.with_overrides(pipeline_model_parallel_layout=uneven_pipeline_layout(126, 16, 2, first=7, last=7))
    rows = est.plan(laid, gpus=128, gpu="h100", mbs=1, gbs=256, tps=[8], recomputes=["full"], fsdps=[None])
    assert {(r.parallel.pp, r.parallel.vpp) for r in rows} == {(16, 2)}  # the layout's, nothing else
    assert rows[0].bubble == pytest.approx(est.bubble(rows[0].parallel, rows[0].num_microbatches))
    uneven = base.with_overrides(num_layers_in_first_pipeline_stage=7, num_layers_in_last_pipeline_stage=7)
    plain = est.plan(uneven, gpus=128, gpu="h100", mbs=1, gbs=256, tps=[8], recomputes=["full"], fsdps=[None])
    assert {r.parallel.vpp for r in plain if r.parallel.pp == 16} == {1}  # Megatron's first/last: no vpp 2 (7 % 2)


def test_a_cpu_plan_fits_this_machines_ram_and_claims_no_speed_until_calibrated():
    """The table's CPU is a nominal 1 TFLOP/s: a plan on it printed every layout of llama-70b as fitting and at
    about 90 % MFU.  Now CPU ranks share this machine's RAM (what fits is measured against it) and no step
    time, MFU or tokens/s is claimed; a calibrated CPU (%mnb plan --calibrate's measurement) gets numbers."""
    from mnb.estimate import hardware
    from mnb.estimate.measured import register_measurement

    big = est.plan("llama-70b", gpus=2, gpu="cpu", gbs=8)
    share = hardware.host_memory_bytes() // 2
    assert all(r.capacity_bytes == share and r.fits == (r.memory_bytes <= share) for r in big)
    assert not big[0].fits  # 600 GiB a rank: no CI or laptop has 1.2 TB of RAM
    rows = est.plan("tiny", gpus=2, gpu="cpu", gbs=8)
    assert all(r.fits for r in rows) and all(r.step_time_s != r.step_time_s for r in rows)  # NaN: not predicted
    assert rows[0].time_estimate.total_s <= rows[-1].time_estimate.total_s  # still ordered by the nominal model
    text = est.format_plan(rows[:3])
    assert "%" not in text.splitlines()[1] and "—" in text and "no step time" in text
    assert "no step time" in rows._repr_html_()
    assert est.memory("tiny", gpus=2, gpu="cpu").capacity_bytes == share
    measured = register_measurement({"gemm": [[512, 512, 512, 2e10], [1024, 1024, 1024, 3e10]],
                                     "copy_bytes_per_s": 5e9, "device_name": "cpu", "world_size": 2})
    calibrated = est.plan("tiny", gpus=2, gpu=measured.name, gbs=8)
    assert not measured.nominal and calibrated[0].capacity_bytes == share
    assert 0 < calibrated[0].mfu <= 1 and calibrated[0].step_time_s > 0
