"""Memory estimator against formulas written out here (not by calling the implementation)."""

from __future__ import annotations

import pytest

import mnb.estimate as est
from mnb.config import ModelConfig, ParallelConfig, TrainConfig, load_preset
from mnb.estimate.activations import LayerShape, layer_activation_bytes

# GPT-3-like layer: MHA, GeLU MLP with ffn = 4h, dropout on, unfused attention:
# the shape Korthikanti et al. 2022 (Table 2) wrote their formulas for.
GPT = ModelConfig(
    name="gpt-test", num_layers=8, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
    vocab_size=51200, max_position_embeddings=2048, seq_length=2048,
    extra={"hidden_dropout": 0.1, "attention_dropout": 0.1},
)
S, B, H, A = 2048, 2, 1024, 16


def shape(tp=1, sp=False, recompute="none", fused=False, seq=S, b=B):
    return LayerShape(seq=seq, micro_batch=b, tp=tp, sequence_parallel=sp, element_bytes=2,
                      recompute=recompute, fused_attention=fused)


def test_korthikanti_no_parallelism():
    expected = S * B * H * (34 + 5 * A * S / H)
    assert layer_activation_bytes(GPT, shape()) == pytest.approx(expected)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_tensor_parallel(t):
    no_sp = S * B * H * (10 + 24 / t + 5 * A * S / (H * t))
    sp = S * B * H / t * (34 + 5 * A * S / H)
    sp_selective = S * B * H * 34 / t
    selective = S * B * H * (10 + 24 / t)
    assert layer_activation_bytes(GPT, shape(tp=t)) == pytest.approx(no_sp)
    assert layer_activation_bytes(GPT, shape(tp=t, sp=True)) == pytest.approx(sp)
    assert layer_activation_bytes(GPT, shape(tp=t, sp=True, recompute="selective")) == pytest.approx(sp_selective)
    assert layer_activation_bytes(GPT, shape(tp=t, recompute="selective")) == pytest.approx(selective)
    # Megatron-LM's estimator (SP + selective): s*b*h*(18 + 4*ffn/h)/t
    megatron = S * B * H * (18 + 4 * 4096 / H) / t
    assert layer_activation_bytes(GPT, shape(tp=t, sp=True, recompute="selective")) == pytest.approx(megatron)


def test_full_recompute_keeps_layer_input():
    assert layer_activation_bytes(GPT, shape(recompute="full")) == 2 * S * B * H
    assert layer_activation_bytes(GPT, shape(tp=4, sp=True, recompute="full")) == 2 * S * B * H / 4


LLAMA = load_preset("llama-7b")  # mnb default: no dropout


def llama_layer(t=1, sp=False, s=4096, b=1):
    """Itemised bf16 layer for Llama (RMSNorm, SwiGLU, RoPE, flash attention, no dropout)."""
    h, a, ffn = 4096, 32, 11008
    q = kv = 4096
    rep = 2 * s * b * h / (t if sp else 1)
    attn = 2 * rep + 2 * s * b * (q + 2 * kv) / t + 2 * s * b * (q + kv) / t + 4 * a / t * s * b + 2 * s * b * q / t
    mlp = 2 * rep + 2 * s * b * 2 * ffn / t + 2 * s * b * ffn / t
    return attn + mlp


def test_weights_grads_optimizer_bytes_per_param():
    n = load_preset("llama-7b").num_parameters()
    train = TrainConfig(bf16=True, global_batch_size=8)
    plain = est.memory("llama-7b", ParallelConfig(), train, gpus=8).stages[0]
    assert plain.params == n
    assert plain.weights_bytes + plain.gradients_bytes + plain.optimizer_bytes == 18 * n
    dist = est.memory("llama-7b", ParallelConfig(), TrainConfig(
        bf16=True, global_batch_size=8, use_distributed_optimizer=True), gpus=8).stages[0]
    assert dist.weights_bytes + dist.gradients_bytes + dist.optimizer_bytes == pytest.approx((6 + 12 / 8) * n)
    fp32 = est.memory("llama-7b", ParallelConfig(dp=1), TrainConfig()).stages[0]
    assert fp32.weights_bytes + fp32.gradients_bytes + fp32.optimizer_bytes == 16 * n


def test_llama_dp8_activations_and_logits():
    train = TrainConfig(bf16=True, global_batch_size=128, use_distributed_optimizer=True)
    m = est.memory(LLAMA, ParallelConfig(), train, gpus=8, gpu="h200")
    st = m.stages[0]
    s, b, h, V = 4096, 1, 4096, 32000
    extras = 2 * 8 * s * b + 2 * 2 * s * b * h  # token/position ids; final norm + output inputs
    assert st.activations_bytes == pytest.approx(32 * llama_layer() + extras)
    assert st.logits_bytes == pytest.approx(s * b * V * (4 + 2))
    assert st.other_bytes == pytest.approx(0.05 * (st.activations_bytes + st.logits_bytes))
    assert m.fits and m.capacity_bytes == est.DEVICES["h200"].capacity_bytes
    assert 60 * 2**30 < m.peak_bytes < 80 * 2**30


def test_fused_loss_keeps_only_the_logits():
    train = TrainConfig(bf16=True, global_batch_size=128)
    plain = est.memory(LLAMA, ParallelConfig(tp=2), train, gpus=8).stages[0]
    fused = est.memory(LLAMA, ParallelConfig(tp=2), train, gpus=8, fused_loss=True).stages[0]
    s, b, V = 4096, 1, 32000
    assert plain.logits_bytes == pytest.approx(s * b * V / 2 * (4 + 2))
    # bf16 logits, no fp32 softmax; in backward their bf16 gradient sits beside them
    assert fused.logits_bytes == pytest.approx(s * b * V / 2 * 2 * 2)
    assert fused.activations_bytes == plain.activations_bytes


def test_stage_params_tp_pp():
    t, pp = 2, 4
    par = ParallelConfig(tp=t, pp=pp, dp=1, sequence_parallel=True)
    h, q, kv, ffn, V, L = 4096, 4096, 4096, 11008, 32000, 32
    layer = (h * (q + 2 * kv) + q * h + 3 * h * ffn) / t + 2 * h
    stages = [est.stage_params(LLAMA, par, r) for r in range(pp)]
    assert stages[0].total == L / pp * layer + V * h / t
    assert stages[1].total == stages[2].total == L / pp * layer
    assert stages[3].total == L / pp * layer + V * h / t + h


@pytest.mark.parametrize("m", [2, 8])
def test_pipeline_stages_hold_min_pp_minus_r_microbatches(m):
    pp, t = 4, 2
    par = ParallelConfig(tp=t, pp=pp, dp=1, sequence_parallel=True)
    train = TrainConfig(bf16=True, global_batch_size=m)
    est_m = est.memory(LLAMA, par, train)
    s, b, h = 4096, 1, 4096
    for r, st in enumerate(est_m.stages):
        acts = min(pp - r, m) * (32 / pp) * llama_layer(t=t, sp=True)
        if r == 0:
            acts += min(pp, m) * 16 * s * b
        if r == pp - 1:
            acts += 2 * 2 * s * b * h / t
        assert st.in_flight_microbatches == min(pp - r, m)
        assert st.activations_bytes == pytest.approx(acts)
        assert (st.logits_bytes > 0) == (r == pp - 1)
    assert est_m.peak_stage in (0, pp - 1)


def test_interleaved_factor_matches_megatron():
    pp, v, m = 4, 2, 8
    par = ParallelConfig(pp=pp, vpp=v, dp=1)
    st0 = est.memory(LLAMA, par, TrainConfig(bf16=True, global_batch_size=m)).stages[0]
    layers_acts = st0.activations_bytes - min(st0.in_flight_microbatches, m) * 16 * 4096
    # Megatron: first stage holds pp microbatches of L/pp layers times 1 + (pp-1)/(pp*vpp)
    expected = pp * (32 / pp) * llama_layer() * (1 + (pp - 1) / (pp * v))
    assert layers_acts == pytest.approx(expected)


def test_full_recompute_and_context_parallel():
    train = TrainConfig(bf16=True, global_batch_size=1, recompute="full")
    st = est.memory(LLAMA, ParallelConfig(dp=1), train).stages[0]
    s, h = 4096, 4096
    expected = 32 * 2 * s * h + llama_layer() + 16 * s + 4 * s * h
    assert st.activations_bytes == pytest.approx(expected)
    cp1 = est.memory(LLAMA, ParallelConfig(dp=1), TrainConfig(bf16=True)).stages[0]
    cp2 = est.memory(LLAMA, ParallelConfig(cp=2, dp=1), TrainConfig(bf16=True)).stages[0]
    # mnb's all-gather cp attention, per layer (bf16, local sequence s/2, MHA: kv = q = 4096):
    s2, q, kv = s // 2, 4096, 4096
    gathered = 2 * (2 * s2) * 2 * kv  # K and V of the whole sequence
    chunk_outputs = 2 * s2 * q  # apart from the output projection's input
    not_saved = 2 * s2 * (q + 2 * kv) + 2 * s2 * kv  # the QKV output and the rotated K
    assert cp2.activations_bytes == pytest.approx(
        cp1.activations_bytes / 2 + 32 * (gathered + chunk_outputs - not_saved))
    assert cp2.logits_bytes == pytest.approx(cp1.logits_bytes / 2)
    # Selective recompute checkpoints the core attention: its inputs are the local Q/K/V only.
    sel = TrainConfig(bf16=True, recompute="selective")
    assert est.memory(LLAMA, ParallelConfig(cp=2, dp=1), sel).stages[0].activations_bytes == pytest.approx(
        est.memory(LLAMA, ParallelConfig(dp=1), sel).stages[0].activations_bytes / 2)


def test_moe_experts_split_by_ep():
    moe = load_preset("moe-tiny")  # 4 experts, top-2, SwiGLU, h 64, moe_ffn 128
    h, E, mffn = 64, 4, 128
    train = TrainConfig(bf16=True, use_distributed_optimizer=True, global_batch_size=4)
    one = est.memory(moe, ParallelConfig(ep=1), train, gpus=4).stages[0]
    four = est.memory(moe, ParallelConfig(ep=4), train, gpus=4).stages[0]
    expert_params = 4 * E * 3 * h * mffn
    assert one.params - four.params == expert_params - expert_params / 4
    # experts: weights 2 B + grads 4 B on every rank; optimizer 12 B sharded over dp/ep ranks
    dense = four.params - expert_params / 4
    assert four.optimizer_bytes == pytest.approx(dense * 12 / 4 + expert_params / 4 * 12 / 1)
    assert four.weights_bytes == pytest.approx(2 * four.params)


def test_stage_of_rank_and_summary():
    m = est.memory("tiny", ParallelConfig(tp=2, pp=2), TrainConfig(global_batch_size=4), gpus=8)
    assert [m.stage_of_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert "stage 1" in m.summary()


def test_invalid_inputs_carry_numbers():
    with pytest.raises(ValueError, match=r"num_attention_heads\(32\).*tp\(3\)"):
        est.memory("llama-7b", ParallelConfig(tp=3), gpus=6)
    with pytest.raises(ValueError, match=r"4 does not divide world size 6"):
        est.memory("llama-7b", ParallelConfig(tp=2, pp=2), gpus=6)
    # Without a world size, dp is the fewest replicas the layout allows.
    assert est.memory("llama-7b", ParallelConfig(tp=2)).parallel.dp == 1
    assert est.memory("mixtral-8x7b", ParallelConfig(ep=4)).parallel.dp == 4
    with pytest.raises(ValueError, match=r"num_microbatches\(2\) is not a multiple of 4.*global_batch_size 4 or 8"):
        est.memory("llama-7b", ParallelConfig(pp=4, vpp=2), TrainConfig(global_batch_size=2), gpus=4)
    with pytest.raises(ValueError, match=r"global_batch_size\(6\).*= 4"):
        est.memory("llama-7b", ParallelConfig(), TrainConfig(global_batch_size=6), gpus=4)
    with pytest.raises(ValueError, match="unknown model preset"):
        est.memory("llama-9000", ParallelConfig(dp=1))


def test_lora_keeps_frozen_weights_without_gradients_or_optimizer_state():
    """mnb.lora freezes the base: its weights stay (bf16 2 B), the adapters alone hold gradients (4 B) and
    Adam (12 B); Llama-3.2-1B-shaped, rank 16 on every projection: 16 * 44,032 adapter parameters a layer."""
    from mnb.config import LoraConfig, ParallelConfig, TrainConfig

    train = TrainConfig(bf16=True)
    full = est.memory("llama-1b", ParallelConfig(), train, gpus=1).stages[0]
    lora = est.memory("llama-1b", ParallelConfig(), train, gpus=1,
                      lora={"rank": 16, "targets": ("all-linear",)}).stages[0]
    adapters = full.num_layers * 16 * ((2048 + 2048) + 2 * (2048 + 512) + (2048 + 2048) + 3 * (2048 + 8192))
    assert lora.params == full.params + adapters
    assert lora.gradients_bytes == adapters * 4 and lora.optimizer_bytes == adapters * 12
    assert lora.weights_bytes == full.params * 2 + adapters * 2
    assert lora.activations_bytes == full.activations_bytes
    # under tp2 the column-parallel B and row-parallel A are split: fewer adapter parameters per rank
    tp2 = est.memory("llama-1b", ParallelConfig(tp=2), train, gpus=2, lora=LoraConfig(rank=16, targets=("q_proj",)))
    assert tp2.assumptions["lora_params_per_layer"] == 16 * (2048 + 2048 // 2)
    with pytest.raises(ValueError, match="unknown LoRA target 'w1'"):
        LoraConfig(targets=("w1",))
    with pytest.raises(ValueError, match="LoRA rank must be a positive integer, got 0"):
        est.memory("llama-1b", ParallelConfig(), train, gpus=1, lora={"rank": 0})
