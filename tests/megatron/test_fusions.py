"""mnb's fused loss and RoPE against Megatron-Core's own arithmetic, and when they switch on."""

import shutil

import pytest
from conftest import ok

pytestmark = pytest.mark.slow


def test_loss_matches_megatron_fp32(world1):
    result = ok(world1["fusions"])
    assert result["loss_diff_float32"] < 1e-5
    assert result["grad_diff_float32"] < 1e-6
    assert result["grad_scale_float32"] > 1e-3  # the gradients compared are not all zero
    assert result["grad_dtype_float32"] == "torch.float32"


def test_loss_by_blocks_matches_megatron_fp32_and_bf16(world1):
    """The eager loss (what runs while the kernels compile) works on blocks of rows; by blocks it is
    Megatron's loss and gradient, and bit for bit the loss in one block."""
    result = ok(world1["fusions"])
    for name in ("float32", "bfloat16"):
        assert result[f"blocks_{name}"] > 1
        assert result[f"blocked_equals_whole_{name}"] is True
    assert result["blocked_loss_diff_float32"] < 1e-5
    assert result["blocked_grad_diff_float32"] < 1e-6
    assert result["blocked_loss_diff_bfloat16"] < 1e-4
    assert result["blocked_grad_diff_bfloat16"] <= result["grad_scale_bfloat16"] / 128  # bf16 rounding only


def test_loss_matches_megatron_bf16_and_keeps_bf16_grads(world1):
    result = ok(world1["fusions"])
    # Both compute in fp32 from the same bf16 logits; gradients differ by bf16 rounding only.
    assert result["loss_diff_bfloat16"] < 1e-4
    assert result["grad_diff_bfloat16"] <= result["grad_scale_bfloat16"] / 128
    assert result["grad_dtype_bfloat16"] == "torch.bfloat16"


def test_rope_matches_megatron(world1):
    result = ok(world1["fusions"])
    assert result["rope_diff"] == 0.0
    assert result["rope_partial_diff"] == 0.0
    assert result["rope_strided_diff"] == 0.0
    assert result["rope_grad_diff"] < 1e-6


def test_swiglu_matches_megatrons_glu(world1):
    result = ok(world1["fusions"])
    assert result["swiglu_diff"] < 1e-6
    assert result["swiglu_grad_diff"] < 1e-5


def test_fused_spec_swaps_the_swiglu_mlp_and_the_norms(world1):
    result = ok(world1["fusions"])
    assert result["fused_mlp"] == "FusedSwiGLUMLP"
    assert result["plain_mlp"] == "MLP"
    assert result["gelu_mlp"] == "MLP"  # GeLU MLPs keep Megatron's
    # the layer's two norms and the final one: mnb's RMSNorm kernels where they run (tests/megatron/test_norm_kernels.py)
    assert result["fused_norms"] == ["FusedLocalNorm"] * 3
    assert result["plain_norms"] == ["LocalNorm"] * 3
    assert result["fused_mlp_diff"] < 1e-5


def test_cpu_ranks_run_megatrons_unfused_ops(world1):
    result = ok(world1["fusions"])
    assert result["auto_on_cpu"] is False
    assert result["auto_model_class"] == "MnbGPTModel"  # Megatron's own loss (the padding hidden), not the fused one
    assert result["auto_rope_fusion"] is False
    assert "fusions=True needs CUDA ranks with Triton" in result["forced_on_cpu"]
    assert "fusions='auto' or False" in result["forced_on_cpu"]


def test_vocab_parallel_loss_over_tp2(world2):
    for rank in world2:
        result = ok(rank["fused-loss-tp2"])
        assert result["loss_diff"] < 1e-5
        assert result["grad_diff"] < 1e-6
        assert result["unsplit_diff"] < 1e-5  # and equal to the loss over the whole vocabulary
        # by blocks of rows (the eager loss while kernels compile), the vocabulary split over tp=2
        assert result["blocks"] > 1 and result["blocked_equals_whole"] is True
        assert result["blocked_loss_diff"] < 1e-5
        assert result["blocked_grad_diff"] < 1e-6


def test_an_unfused_step_while_compiling_keeps_to_the_estimate(tmp_path):
    """Every tensor of a fused model's second step, run unfused while its kernels compile, counted as it
    is made and freed: the most held at once stays within mnb.estimate.memory's activations, logits and
    overhead.  The eager loss made whole-size fp32 temporaries of the logits: 1.44x the estimate on this
    shape, and on an H200 llama-3b at micro batch 8 ran out of memory at step 2 (issue 39)."""
    from ranks import run_ranks
    from scenarios import unfused_step_memory

    result = run_ranks(unfused_step_memory, 1, tmp_path, timeout_s=600)[0]
    assert result["model_class"] == "FusedLossGPTModel"
    assert result["compiling"] == [True, True] and result["compile_pending"] is True
    assert result["eager_calls"] > 0 and result["compiled_calls"] == 0
    assert result["step_peak_bytes"] > result["estimate_activations_bytes"]  # it counted the step
    assert result["step_peak_bytes"] <= result["estimate_step_bytes"], result


NEEDS_COMPILER = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="torch.compile on CPU needs a C compiler")


@NEEDS_COMPILER
def test_first_steps_run_unfused_while_compiling_then_switch(tmp_path):
    """mnb.gpt returns before the kernels compile: steps 1-3 run unfused (the compile is held until step 2
    ends), 4-6 the compiled kernels; the same losses as the unfused model (bf16); and once compiled,
    Megatron's view chains and micro batch 1 and 2 compile nothing more (the warm-up covered them)."""
    from ranks import run_ranks
    from scenarios import fused_first_steps

    result = run_ranks(fused_first_steps, 1, tmp_path, timeout_s=600)[0]
    assert result["fused_class"] == "FusedLossGPTModel" and result["rope_fusion"] is True
    assert result["ready"] is True
    assert result["compiling"] == [True, True, True, False, False, False]
    assert "steps 1\u20133 unfused while compiling" in result["summary"], result["summary"]
    assert result["calls"]["compiled"] > 0 and result["calls"]["eager"] > 0, result["calls"]  # step 3, steps 4-6
    frames = result["frames"]
    assert frames["after_compile"] > 0
    assert frames["after_switch"] == frames["after_compile"], frames
    assert frames["after_mbs2"] == frames["after_compile"], frames
    losses = result["losses"]  # same initial weights and data: the same loss, fused or not (bf16)
    assert losses["switched"] == pytest.approx(losses["plain"], rel=1e-2)
    assert losses["fused_mbs2"] == pytest.approx(losses["plain_mbs2"], rel=1e-2)


@NEEDS_COMPILER
def test_changing_tp_compiles_nothing(tmp_path):
    """The first model's warm-up prepares every SwiGLU width the pool's tp sizes give."""
    from ranks import run_ranks
    from scenarios import fused_relayout

    for result in run_ranks(fused_relayout, 2, tmp_path, timeout_s=600):
        frames = result["frames"]
        assert frames["tp1_after_gpt"] > 0
        assert frames["tp1_after_gpt"] == frames["tp1_after_step"] == frames["tp2_after_gpt"] \
            == frames["tp2_after_step"], frames
        # Same initial weights and data under both layouts (bf16).
        assert result["losses"]["tp2"] == pytest.approx(result["losses"]["tp1"], rel=1e-2)


def test_swiglu_widths_cover_the_tp_sizes():
    from mnb.megatron.fusions import swiglu_widths

    assert swiglu_widths(8192, 8) == (16384, 8192, 4096, 2048)
    assert swiglu_widths(8192, 2) == (16384, 8192)
    assert swiglu_widths(96, 6) == (192, 96, 64, 32)  # tp 4 does not divide 6
    assert swiglu_widths(100, 8) == (200, 100, 50)  # tp 8 does not divide the ffn



def test_a_compiled_kernel_called_while_another_thread_traces_runs_eagerly():
    """FX's "tracing now" flag is process-wide: a background compile's trace set it for the
    training thread too, and Dynamo raised there (the first llama-1b step on a fresh H200)."""
    import torch
    import torch.fx._symbolic_trace as fx_trace

    from mnb.megatron import fusions

    y = torch.randn(4, 8)
    kernel = fusions._kernel(fusions._swiglu, compiled=True)
    fx_trace._is_fx_tracing_flag = True  # what another thread's make_fx/symbolic_trace sets
    try:
        out = kernel(y)
    finally:
        fx_trace._is_fx_tracing_flag = False
    assert torch.equal(out, fusions._swiglu(y))

@NEEDS_COMPILER
def test_compiled_pieces_match_eager(tmp_path, monkeypatch):
    """The torch.compile'd kernels (the GPU path) compute what the eager pieces do.

    Compiled here with Inductor's CPU backend, in this process (no process group: tp=1).
    """
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    import torch

    from mnb.megatron import fusions

    gen = torch.Generator().manual_seed(11)
    logits = (4 * torch.randn(6, 2, 384, generator=gen)).to(torch.bfloat16)
    target = torch.randint(0, 384, (6, 2), generator=gen)
    results = {}
    for compiled in (False, True):
        leaf = logits.clone().requires_grad_(True)
        loss = fusions.vocab_parallel_cross_entropy(leaf, target, None, compiled=compiled)
        loss.sum().backward()
        results[compiled] = (loss.detach(), leaf.grad.float())
    assert torch.allclose(results[True][0], results[False][0], atol=1e-5)
    assert torch.allclose(results[True][1], results[False][1], atol=1e-3)

    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    for seq in (6, 9):  # RoPE against Megatron's own unfused one, for two sequence lengths
        freqs = torch.randn(seq, 1, 1, 16, generator=gen)
        t = torch.randn(seq, 2, 4, 16, generator=gen, requires_grad=True)
        megatron = _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False)
        (grad_megatron,) = torch.autograd.grad(megatron.sum() + (megatron ** 2).sum(), t)
        for compiled in (False, True):
            ours = fusions.fused_rope(t, freqs, compiled=compiled)
            assert torch.allclose(ours, megatron, atol=1e-5)
            (grad,) = torch.autograd.grad(ours.sum() + (ours ** 2).sum(), t)
            assert torch.allclose(grad, grad_megatron, atol=1e-5)

    for tokens in (6, 10):  # one compile for every token count
        x = torch.randn(tokens, 2, 32, generator=gen, requires_grad=True)
        eager = fusions.swiglu(x, compiled=False)
        compiled = fusions.swiglu(x, compiled=True)
        assert torch.allclose(compiled, eager, atol=1e-5)
        (grad_eager,) = torch.autograd.grad(eager.sum(), x)
        (grad_compiled,) = torch.autograd.grad(compiled.sum(), x)
        assert torch.allclose(grad_compiled, grad_eager, atol=1e-5)
