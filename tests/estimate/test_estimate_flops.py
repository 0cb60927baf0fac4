"""FLOPs and MFU against hand calculations and the 6*N*tokens rule."""

from __future__ import annotations

import pytest

import mnb.estimate as est
from mnb.config import TrainConfig, load_preset


def test_tiny_by_hand():
    # tiny: L=4, h=64, 4 heads of 16, 2 query groups, SwiGLU ffn 176, vocab 512, seq 64
    L, h, q, kv, ffn, V, s = 4, 64, 64, 32, 176, 512, 64
    per_token = (
        6 * h * ffn * 3 * L  # SwiGLU MLP: 3 GEMMs of h x ffn
        + L * 6 * (h * (q + 2 * kv) + q * h)  # QKV + proj, GQA
        + L * 6 * q * s  # causal core attention (half of QK^T and AV)
        + 6 * h * V  # logits
    )
    train = TrainConfig(global_batch_size=8)
    assert est.flops("tiny", train, causal=True) == 8 * s * per_token
    assert est.flops("tiny", train) == 8 * s * (per_token + L * 6 * q * s)  # default: full s*s matrix
    assert est.flops("tiny", TrainConfig(micro_batch_size=2), causal=True) == 2 * s * per_token  # gbs None -> mbs


def test_gpt2_matches_narayanan_closed_form():
    # Narayanan et al. 2021 appendix: 72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)) without recompute
    # (their 96 includes one recomputed forward), full attention matrix, padded vocab.
    B, s, L, h, V = 16, 1024, 12, 768, 50304
    expected = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    got = est.flops("gpt2-124m", TrainConfig(global_batch_size=B))
    assert got == pytest.approx(expected, rel=1e-12)


def test_moe_counts_top_k_experts():
    m = load_preset("moe-tiny")  # top-2 of 4 experts, moe_ffn 128
    dense_equiv = m.with_overrides(num_moe_experts=None, ffn_hidden_size=2 * 128)
    assert est.flops(m, TrainConfig()) == est.flops(dense_equiv, TrainConfig())


def test_llama7b_close_to_6N_tokens():
    model = load_preset("llama-7b")
    train = TrainConfig(global_batch_size=128)
    tokens = 128 * 4096
    f = est.flops(model, train, causal=True)
    n = model.num_parameters()
    assert f == pytest.approx(6 * n * tokens, rel=0.10)
    # Kaplan et al. 2020: 6*N_nonembedding + 6*L*s*d_attn per token (causal), N with the output layer
    n_no_input_embedding = n - model.vocab_size * model.hidden_size
    kaplan = tokens * (6 * n_no_input_embedding + 6 * 32 * 4096 * 4096)
    assert f == pytest.approx(kaplan, rel=0.01)


def test_hardware_flops_adds_recompute():
    train = TrainConfig(global_batch_size=4)
    model_f = est.flops("llama-7b", train)
    assert est.hardware_flops("llama-7b", train, recompute="none") == model_f
    assert model_f < est.hardware_flops("llama-7b", train, recompute="selective") < model_f * 1.05
    assert est.hardware_flops("llama-7b", train, recompute="full") == pytest.approx(model_f * 4 / 3, rel=0.02)


def test_mfu():
    train = TrainConfig(global_batch_size=128, bf16=True)
    f = est.flops("llama-7b", train)
    assert est.mfu("llama-7b", train, step_time_s=6.0, num_gpus=8, gpu="h200") == pytest.approx(f / (6 * 8 * 989e12))
    assert est.mfu(flops_per_step=f, step_time_s=6.0, num_gpus=8, gpu="h200-measured") == pytest.approx(
        f / (6 * 8 * 790e12))
    assert est.mfu(flops_per_step=1e12, step_time_s=1.0, num_gpus=1, peak_flops=2e12) == 0.5
    assert est.mfu(flops_per_step=1e11, step_time_s=1.0, num_gpus=1, gpu="cpu") > 0
    for name, peak in (("h100", 989e12), ("a100", 312e12), ("b200", 2250e12)):
        assert est.peak_flops(name) == peak


def test_hardware_lookup():
    assert est.hardware.device_from_name("NVIDIA H200").name == "h200"
    assert est.hardware.device_from_name("NVIDIA A100-SXM4-80GB").name == "a100"
    assert est.hardware.device_from_name("Tesla T4") is None
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        est.peak_flops("tpu")


def test_mfu_errors():
    with pytest.raises(ValueError, match="step_time_s must be positive, got 0"):
        est.mfu("tiny", step_time_s=0, num_gpus=1)
    with pytest.raises(ValueError, match="num_gpus must be a positive integer, got 0"):
        est.mfu("tiny", step_time_s=1.0, num_gpus=0)
    with pytest.raises(ValueError, match="flops_per_step"):
        est.mfu(step_time_s=1.0, num_gpus=1)
