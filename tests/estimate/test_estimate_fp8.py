"""The estimate of a model with FP8 linears (ModelConfig.fp8): their GEMMs at the FP8 peak, the rest at bf16."""

from __future__ import annotations

import pytest

import mnb.estimate as est
from mnb.config import ParallelConfig, TrainConfig, model_config
from mnb.estimate import hardware


def parts(estimate) -> dict[str, float]:
    return dict(estimate.compute_parts)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_the_linear_gemms_run_at_the_fp8_peak(recipe):
    train = TrainConfig(bf16=True, micro_batch_size=4, global_batch_size=16)
    layout = ParallelConfig()
    bf16 = est.step_time(model_config("llama-3b", seq_length=2048), layout, train, gpus=1, gpu="h200")
    fp8 = est.step_time(model_config("llama-3b", seq_length=2048, fp8=recipe), layout, train, gpus=1, gpu="h200")
    h200 = hardware.device("h200")
    # the logits GEMM stays bf16: the GEMM part is the linears at half the time plus the same logits
    logits = bf16.compute_parts and est.kernels.gemm_time(h200, h200.bf16_flops, 4 * 2048, 128256, 3072)
    logits += est.kernels.gemm_time(h200, h200.bf16_flops, 4 * 2048, 128256, 3072, backward=True)
    linears_bf16 = parts(bf16)["GEMM"] / 4 - logits  # per microbatch
    linears_fp8 = parts(fp8)["GEMM"] / 4 - logits
    fp8_peak = est.kernels.fp8_peak(h200, h200.bf16_flops)
    assert fp8_peak == pytest.approx(h200.fp8_flops * est.kernels.FP8_GEMM_EFFICIENCY)
    assert linears_fp8 == pytest.approx(linears_bf16 * h200.bf16_flops / fp8_peak, rel=1e-9)
    assert parts(fp8)["core attention"] == parts(bf16)["core attention"]
    assert parts(fp8)["elementwise and norms"] > parts(bf16)["elementwise and norms"]  # the casts
    assert fp8.model_flops == bf16.model_flops
    assert fp8.peak_flops == bf16.peak_flops  # MFU stays against the bf16 peak


def test_delayed_scaling_costs_the_casts_one_read_less():
    """fp8='delayed' reads each cast tensor once (the scale from the history), tensorwise twice: the casts' share
    of the step shrinks by the amax reads, and nothing else changes."""
    train = TrainConfig(bf16=True, micro_batch_size=4, global_batch_size=16)
    bf16, tw, delayed = (est.step_time(model_config("llama-3b", seq_length=2048, fp8=r), ParallelConfig(), train,
                                       gpus=1, gpu="h200") for r in (None, "tensorwise", "delayed"))
    elementwise = [parts(e)["elementwise and norms"] for e in (bf16, tw, delayed)]
    assert elementwise[0] < elementwise[2] < elementwise[1]
    assert parts(delayed)["GEMM"] == parts(tw)["GEMM"] and delayed.tokens_per_s > tw.tokens_per_s
    k, n = 3072, 8192  # linear_fc2 of llama-3b: 8192 inputs -> 3072 outputs; the casts per token, each way
    assert est.kernels.fp8_cast_bytes("tensorwise", n, k) == (5 * k, 7 * n + 2 * k)
    assert est.kernels.fp8_cast_bytes("delayed", n, k) == (3 * k, 5 * n + 2 * k)  # 2 bytes less per element


def test_a_gpu_without_fp8_tensor_cores_is_refused():
    with pytest.raises(ValueError, match="no FP8 peak"):
        est.step_time(model_config("llama-1b", fp8="tensorwise"), ParallelConfig(), TrainConfig(bf16=True),
                      gpus=1, gpu="a100")


def test_plan_magic_takes_fp8(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    shell.run_line_magic("mnb", "plan --model llama-3b --gpus 1 --mbs 4 --top 1")
    bf16 = capsys.readouterr().out
    shell.run_line_magic("mnb", "plan --model llama-3b --gpus 1 --mbs 4 --top 1 --fp8 tensorwise")
    fp8 = capsys.readouterr().out

    def tokens_per_s(text: str) -> int:
        return int(text.strip().splitlines()[-1].split()[-1].replace(",", ""))

    train = TrainConfig(bf16=True, micro_batch_size=4, global_batch_size=16)
    want = est.step_time(model_config("llama-3b", fp8="tensorwise"), ParallelConfig(), train, gpus=1).tokens_per_s
    assert tokens_per_s(fp8) == round(want) and tokens_per_s(fp8) != tokens_per_s(bf16)


def test_memory_counts_the_fp8_weight_copies_of_a_step():
    """Two 1-byte copies (forward and transposed) of every layer linear's weight during a step."""
    train = TrainConfig(bf16=True, micro_batch_size=1)
    base = est.memory(model_config("llama-1b"), ParallelConfig(tp=2), train, gpus=2)
    fp8 = est.memory(model_config("llama-1b", fp8="rowwise"), ParallelConfig(tp=2), train, gpus=2)
    m = model_config("llama-1b")
    per_layer = m.hidden_size * (m.num_attention_heads * m.head_dim * 2 + 2 * m.query_groups * m.head_dim) \
        + 3 * m.ffn * m.hidden_size
    extra = fp8.stages[0].weights_bytes - base.stages[0].weights_bytes
    assert extra == pytest.approx(2 * m.num_layers * per_layer / 2)
