"""FP8 linears on the local spec (mnb.megatron.fp8): the quantise/scale logic against torchao's definitions,
the autograd Function against an fp32 emulation of torch._scaled_mm, training under tp2 + sp on CPU ranks
(torch's CPU _scaled_mm, the same Function and communication as on a GPU), and the refusals."""

from __future__ import annotations

import pytest
import torch

from mnb.config import ParallelConfig
from mnb.errors import CompositeRankError
from mnb.megatron import fp8

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def dequantized(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return data.to(torch.float32) / scale


def emulate(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, name: str):
    """The three GEMMs as _scaled_mm defines them, in fp32: each operand quantised (value * scale, saturated,
    rounded to the format), dequantised, multiplied; the recipe's scaling for each operand."""
    grad_dtype = torch.float8_e4m3fn if name == "rowwise" else torch.float8_e5m2
    rowwise = name == "rowwise"

    def q(t, dtype, axis):
        fmax = torch.finfo(dtype).max
        amax = t.abs().amax() if not rowwise else t.abs().amax(dim=axis, keepdim=True)
        scale = (fmax / amax.double().clamp(min=1e-12)).float()
        if rowwise:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        return (t.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale

    out = q(x, torch.float8_e4m3fn, -1) @ q(w, torch.float8_e4m3fn, -1).t()
    dgrad = q(g, grad_dtype, -1) @ q(w, torch.float8_e4m3fn, 0)
    wgrad = q(g, grad_dtype, 0).t() @ q(x, torch.float8_e4m3fn, 0)
    return out, dgrad, wgrad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name", fp8.RECIPES)
def test_scales_follow_torchaos_recipe(name):
    """tensorwise: one scale max/amax per tensor (E4M3; gradients E5M2); rowwise: one per row, a power of two;
    delayed: tensorwise's outside a training step."""
    rc = fp8.recipe(name)
    x = torch.randn(32, 64, dtype=torch.bfloat16) * 3
    x[5, 7] = 100.0  # the amax
    data, scale = fp8.cast(x, fp8.E4M3, rc.axis(-1), rc.pow2)
    assert data.dtype == torch.float8_e4m3fn
    if not rc.rowwise:
        assert scale.shape == () and scale.item() == pytest.approx(E4M3_MAX / 100.0, rel=1e-6)
        assert rc.grad_dtype == torch.float8_e5m2
        assert data.float().abs().max().item() == E4M3_MAX  # the amax lands on the format's largest value
    else:
        assert scale.shape == (32, 1) and rc.grad_dtype == torch.float8_e4m3fn
        assert torch.equal(scale, torch.exp2(torch.floor(torch.log2(scale))))  # powers of two
        assert scale[5].item() == 4.0  # 448 / 100 = 4.48, rounded down to a power of two
        assert (data.float().abs().amax(dim=1) <= E4M3_MAX).all()
    # saturation, not inf: a value past the range after scaling stays at the format's max
    big = torch.tensor([[1.0, 2.0] + [0.0] * 14], dtype=torch.bfloat16)
    clipped = fp8.cast(big, fp8.E5M2, None, False)[0]
    assert torch.isfinite(clipped.float()).all()


def test_the_compiled_cast_writes_both_layouts_as_the_eager_cast_does():
    """What CUDA ranks run: the cast through torch.compile (here Inductor's C++ backend) gives the eager cast's
    data, its transpose laid out row by row, and its scale, bit for bit, for each token count one graph serves."""
    torch._dynamo.reset()
    fp8.COMPILE_ON_CPU = True
    try:
        for tokens in (48, 80):  # the token count is symbolic: one graph
            x = torch.randn(tokens, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(tokens)) * 5
            data, data_t, scale = fp8.cast_layouts(x, fp8.E5M2, None, False, transposed=True)
            none, only_t, row_scale = fp8.cast_layouts(x, fp8.E4M3, 0, True, rows=False, transposed=True)
            eager, eager_scale = fp8._cast_eager(x, fp8.E5M2, None, False)
            eager_rows, eager_row_scale = fp8._cast_eager(x, fp8.E4M3, 0, True)
            assert torch.equal(data.view(torch.uint8), eager.view(torch.uint8)) and torch.equal(scale, eager_scale)
            assert data_t.is_contiguous()
            assert torch.equal(data_t.view(torch.uint8), eager.t().contiguous().view(torch.uint8))
            assert none is None and torch.equal(row_scale, eager_row_scale)
            assert torch.equal(only_t.view(torch.uint8), eager_rows.t().contiguous().view(torch.uint8))
        assert not fp8._compile_failed, fp8._compile_failed
        # an input the eager cast refuses too (no tokens: no amax) raises, and leaves the compiled cast in charge
        with pytest.raises(Exception):  # noqa: B017 - whichever error the amax of nothing gives
            fp8.cast_layouts(torch.zeros(0, 32, dtype=torch.bfloat16), fp8.E4M3, None, False)
        assert not fp8._compile_failed, fp8._compile_failed
    finally:
        fp8.COMPILE_ON_CPU = False


@pytest.mark.parametrize("name", fp8.RECIPES)
def test_the_function_is_scaled_mm_of_the_quantised_operands(name):
    """FP8Linear's forward, input gradient and weight gradient equal the fp32 emulation of the recipe's
    quantisation (to bf16 rounding), and the bf16 linear within FP8's error (E4M3: 3 mantissa bits)."""
    torch.manual_seed(0)
    rc = fp8.recipe(name)
    x = torch.randn(64, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(96, 128) * 0.02).to(torch.bfloat16).requires_grad_()
    bias = torch.randn(96, dtype=torch.bfloat16, requires_grad=True)
    y = fp8.FP8Linear.apply(x, w, bias, rc, False, False, None)
    g = torch.randn_like(y)
    y.backward(g)
    out, dgrad, wgrad = emulate(x.detach().reshape(-1, 128), w.detach(), g.reshape(-1, 96), name)
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16 and x.grad.shape == x.shape
    assert rel(y.reshape(-1, 96) - bias.detach(), out) < 1e-2
    assert rel(x.grad.reshape(-1, 128), dgrad) < 1e-2
    assert rel(w.grad, wgrad) < 1e-2
    assert torch.allclose(bias.grad.float(), g.reshape(-1, 96).float().sum(0), rtol=1e-2, atol=1e-1)
    exact = x.detach().float().reshape(-1, 128) @ w.detach().float().t()
    assert 1e-3 < rel(y.reshape(-1, 96) - bias.detach(), exact) < 2 ** -4  # E4M3 x E4M3: a few percent
    assert rel(x.grad.reshape(-1, 128), g.float().reshape(-1, 96) @ w.detach().float()) < 2 ** -3


def test_a_step_casts_each_weight_once():
    """Inside weight_cache() (one training step) the forward and the input gradient each cast a weight once,
    whatever the microbatches; outside it every call casts afresh."""
    rc = fp8.recipe("tensorwise")
    w = (torch.randn(32, 64) * 0.02).to(torch.bfloat16).requires_grad_()
    calls = []
    real = fp8._cast_eager

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    fp8._cast_eager = counted
    try:
        with fp8.weight_cache():
            for _ in range(3):
                x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
                fp8.FP8Linear.apply(x, w, None, rc, False, False, None).sum().backward()
        in_step = calls.count(w.shape)
        calls.clear()
        x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
        fp8.FP8Linear.apply(x, w, None, rc, False, False, None).sum().backward()
    finally:
        fp8._cast_eager = real
    assert in_step == 2  # forward layout + input-gradient layout, once for three microbatches
    assert calls.count(w.shape) == 2


def test_delayed_scales_come_from_the_linears_history_inside_a_step():
    """fp8='delayed' in a training step: a linear's input and output-gradient casts take their scale from the
    amaxes of that linear's earlier casts (the first from its own), so a tensor larger than the history
    saturates; outside a step each tensor is scaled by its own amax and the history is left alone."""
    from mnb.megatron import fp8_delayed

    rc = fp8.recipe("delayed")
    w = (torch.randn(32, 64) * 0.02).to(torch.bfloat16)
    histories = (fp8_delayed.AmaxHistory(2), fp8_delayed.AmaxHistory(2))
    scales = []
    real = fp8.scaled_mm

    def recorded(a, a_scale, b, b_scale, out_dtype, *, fast_accum):
        scales.append(float(a_scale))
        return real(a, a_scale, b, b_scale, out_dtype, fast_accum=fast_accum)

    def step_input(amax):
        x = torch.randn(16, 64).clamp(-1, 1)
        x[3, 4] = amax
        return x.to(torch.bfloat16).requires_grad_()

    fp8.scaled_mm = recorded
    try:
        with fp8.weight_cache():
            outs = []
            for amax in (2.0, 4.0, 1.0, 1.0):  # a linear's input over four micro batches
                x = step_input(amax)
                y = fp8.FP8Linear.apply(x, w.clone().requires_grad_(), None, rc, False, False, None, histories)
                y.backward(torch.ones_like(y))
                outs.append((x, y))
        forward = scales[0::3]  # each micro batch: forward, input gradient, weight gradient
        assert forward == pytest.approx([E4M3_MAX / 2, E4M3_MAX / 2, E4M3_MAX / 4, E4M3_MAX / 4], rel=1e-6)
        # the second micro batch's 4.0 was cast at the first one's scale: it saturated at 448 / 224 = 2
        x, y = outs[1]
        clipped = x.detach().float().clone()
        clipped[3, 4] = 2.0
        assert float((y.float() - clipped @ w.float().t()).abs().max()) < 0.05
        assert float((y.float() - x.detach().float() @ w.float().t()).abs().max()) > 0.01
        assert histories[0].calls == 4 and histories[0].amax() == 1.0  # the last two: 1.0, 1.0
        assert histories[1].calls == 4
        scales.clear()
        x = step_input(8.0)  # outside a step (mnb.evaluate, mnb.generate): its own amax
        fp8.FP8Linear.apply(x, w, None, rc, False, False, None, histories)
        assert scales == pytest.approx([E4M3_MAX / 8]) and histories[0].calls == 4
    finally:
        fp8.scaled_mm = real


def test_an_amax_history_needs_an_entry():
    from mnb.megatron import fp8_delayed

    with pytest.raises(ValueError, match="at least one entry"):
        fp8_delayed.AmaxHistory(0)
    with pytest.raises(ValueError, match=r"\[tokens, width\]"):
        fp8_delayed.cast(torch.ones(2, 3, 16), fp8.E4M3, fp8_delayed.AmaxHistory())


TRAIN = '''
import mnb.megatron.fp8 as _fp8
_fp8.RUN_ON_CPU = True
try:
    out = {}
    for _name in ("bf16", "tensorwise", "rowwise", "delayed"):
        _m = mnb.gpt("tiny", fp8=None if _name == "bf16" else _name, ffn_hidden_size=256, fusions=False)
        _r = mnb.train(_m, steps=3, micro_batch_size=2, global_batch_size=2, bf16=True, lr=1e-3)
        out[_name] = [row["loss"] for row in _r["steps"]]
        out[_name + "_recipe"] = _fp8.installed(_m.chunks)
finally:
    _fp8.RUN_ON_CPU = False
out
'''


def test_fp8_training_under_tp2_and_sp_follows_bf16(cpu_pool):
    """The FP8 Function inside Megatron's ColumnParallel/RowParallelLinear under tp2 + sequence parallel (all-gather
    of the input, reduce-scatter of its gradient): three steps follow the bf16 losses within FP8's error."""
    got = cpu_pool.run(TRAIN, layout=ParallelConfig(tp=2, sequence_parallel=True), quiet=True)
    for rank in (0, 1):
        out = got[rank]
        assert out["bf16_recipe"] is None
        for name in ("tensorwise", "rowwise", "delayed"):
            assert out[name + "_recipe"] == name
            assert out[name] == pytest.approx(out["bf16"], rel=2e-3), (name, out)
            assert out[name] != out["bf16"]  # it did run FP8 GEMMs


def test_fp8_is_refused_on_cpu_ranks_before_any_collective(cpu_pool):
    with pytest.raises(CompositeRankError) as err:
        cpu_pool.run("mnb.gpt('tiny', fp8='tensorwise')", quiet=True)
    text = str(err.value)
    assert "FP8 tensor cores" in text and "this rank runs on CPU" in text
    assert cpu_pool.run("1 + 1", quiet=True) == {0: 2, 1: 2}  # the pool is usable afterwards


def test_the_refusal_names_the_gpu_and_the_needed_capability():
    reason = fp8.refusal(torch.device("cpu"))
    assert "compute capability >= 8.9" in reason and "drop fp8=" in reason


def test_linears_whose_widths_scaled_mm_cannot_take_are_refused_with_the_width(cpu_pool):
    code = ("import mnb.megatron.fp8 as _fp8\n_fp8.RUN_ON_CPU = True\n"
            "try:\n    mnb.gpt('tiny', fp8='rowwise', fusions=False)\nfinally:\n    _fp8.RUN_ON_CPU = False")
    with pytest.raises(CompositeRankError) as err:
        cpu_pool.run(code, layout=ParallelConfig(tp=2), quiet=True)  # tiny's ffn 176 / tp 2 = 88 per rank
    assert "needs multiples of 16" in str(err.value) and "linear_fc2 is 64 x 88" in str(err.value)


def test_an_fp8_model_is_refused_fp32_training_and_tes_fp8_on_top(cpu_pool):
    cpu_pool.run("import mnb.megatron.fp8 as _fp8\n_fp8.RUN_ON_CPU = True\n"
                 "try:\n    _m = mnb.gpt('tiny', fp8='tensorwise', ffn_hidden_size=256, fusions=False)\n"
                 "finally:\n    _fp8.RUN_ON_CPU = False", quiet=True)
    with pytest.raises(CompositeRankError, match="train it with bf16=True"):
        cpu_pool.run("mnb.train(_m, steps=1)", quiet=True)
    with pytest.raises(CompositeRankError, match="drop fp8=True from mnb.train|Transformer Engine's FP8"):
        cpu_pool.run("mnb.train(_m, steps=1, bf16=True, fp8=True)", quiet=True)
