"""Rank-side bodies for the mnb.megatron tests (run by ranks.run_ranks in fresh processes).

Each body runs several independent checks and returns JSON-able results keyed by
name; a check that raises stores its traceback under "error" so the tests report
it, without the other checks being lost.  Bodies run the same sequence on every
rank, so collectives line up.
"""

from __future__ import annotations

import traceback

PARITY_STEPS = 10
PARITY_BATCH = dict(micro_batch_size=1, global_batch_size=4, lr=1e-3)

# GPT-2-shaped variant of the tiny preset: LayerNorm with biases, GELU, learned
# positions, tied input/output embeddings (with pp > 1: Megatron's embedding group).
GPT_STYLE = dict(normalization="LayerNorm", gated_linear_unit=False, activation="gelu",
                 position_embedding_type="learned_absolute", add_bias_linear=True,
                 share_embeddings_and_output_weights=True)
REFERENCES = {"tiny": ("tiny", {}), "moe-tiny": ("moe-tiny", {}), "gpt-style": ("tiny", GPT_STYLE)}

# name -> (reference name, ParallelConfig kwargs, extra train kwargs); models from REFERENCES
WORLD2_LAYOUTS = {
    "tp2": ("tiny", dict(tp=2), {}),
    "tp2-sp": ("tiny", dict(tp=2, sequence_parallel=True), {}),
    "pp2": ("tiny", dict(pp=2), {}),
    "dp2": ("tiny", dict(), {}),
    "dp2-distopt": ("tiny", dict(), dict(use_distributed_optimizer=True)),
    "pp2-vpp2": ("tiny", dict(pp=2, vpp=2), {}),
    "moe-ep2": ("moe-tiny", dict(ep=2), {}),
    "moe-tp2-sp": ("moe-tiny", dict(tp=2, sequence_parallel=True), {}),
    "gpt-style-pp2-tied": ("gpt-style", dict(pp=2), {}),
    "gpt-style-tp2-sp": ("gpt-style", dict(tp=2, sequence_parallel=True), {}),
}


def _guard(results: dict, name: str, fn) -> None:
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()}


def _losses(record: dict) -> list[float]:
    return [row["loss"] for row in record["steps"]]


def _train(preset, parallel_kw, gpt_kw=None, steps=PARITY_STEPS, **train_kw):
    from mnb.config import ParallelConfig
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt
    from mnb.megatron.train import train

    apply_layout(ParallelConfig(**parallel_kw))
    model = gpt(preset, **(gpt_kw or {}))
    return train(model, steps=steps, **{**PARITY_BATCH, **train_kw})


# ---------------------------------------------------------------- world size 1


def world1(tmp: str) -> dict:
    results: dict = {}
    _guard(results, "cpu", cpu_checks)
    _guard(results, "checkpoint", lambda: checkpoint_roundtrip(tmp))
    _guard(results, "sdpa", sdpa_vs_megatron)
    _guard(results, "fusions", fusions_vs_megatron)
    for name, (preset, gpt_kw) in REFERENCES.items():
        _guard(results, f"ref-{name}", lambda: _losses(_train(preset, {}, gpt_kw)))
    _guard(results, "recompute-full", lambda: _losses(_train("tiny", {}, recompute="full")))
    _guard(results, "recompute-selective", lambda: _losses(_train("tiny", {}, recompute="selective")))
    _guard(results, "continue", continue_training)
    _guard(results, "events", events_seen)
    _guard(results, "oom", oom_message)
    _guard(results, "bf16", lambda: _losses(_train("tiny", {}, steps=3, bf16=True)))
    return results


def cpu_checks() -> dict:
    import importlib
    import sys

    import numpy
    import torch

    import megatron.core.pipeline_parallel.schedules as schedules
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import token_dispatcher
    from mnb.megatron import cpu

    out: dict = {"installed": cpu.installed()}
    mt = schedules.torch
    out["proxy_is_not_torch"] = mt is not torch
    out["factory_device"] = mt.zeros(2, device="cuda").device.type
    out["factory_int_device"] = mt.empty(2, device=mt.cuda.current_device()).device.type
    out["pin_memory_dropped"] = mt.tensor([1], device="cuda", pin_memory=True).is_pinned()
    out["current_device"] = str(mt.cuda.current_device())
    out["synchronize"] = mt.cuda.synchronize() is None
    stream = mt.cuda.Stream()
    stream.wait_stream(mt.cuda.current_stream())
    with mt.cuda.stream(stream):
        pass
    event = mt.cuda.Event(enable_timing=True)
    event.record()
    out["stream_event_inert"] = event.query()
    with mt.autocast("cuda", dtype=torch.bfloat16):
        out["autocast_cpu"] = torch.is_autocast_enabled("cpu")
    # The real torch is untouched for non-Megatron code.
    try:
        torch.zeros(1, device="cuda")
        out["real_torch_cuda_raises"] = False
    except (RuntimeError, AssertionError):
        out["real_torch_cuda_raises"] = True
    t = torch.ones(2)
    megatron_ns = {"__name__": "megatron.core.fake_module", "t": t}
    exec("r_cuda = t.cuda()\nr_type = t.type()", megatron_ns)
    out["megatron_cuda_is_self"] = megatron_ns["r_cuda"] is t
    out["megatron_type"] = megatron_ns["r_type"]
    out["user_type"] = t.type()
    try:
        t.cuda()
        out["user_cuda_raises"] = False
    except (RuntimeError, AssertionError):
        out["user_cuda_raises"] = True
    # RNG state get/set act on the CPU generator (activation recompute replays dropout).
    state = mrandom._get_cuda_rng_state()
    a = torch.rand(3)
    mrandom._set_cuda_rng_state(state)
    out["rng_replay"] = bool(torch.equal(a, torch.rand(3)))
    # clip_grads: 'torch.cuda.FloatTensor' assert and device='cuda' buffer.
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=6.0)
    out["clip_grad_scaled"] = float(p.grad[0])
    # MoE split sizes come back as numpy on CPU.
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    out["moe_splits_numpy"] = isinstance(splits, numpy.ndarray)
    # A Megatron module imported after install() is patched by the import hook.
    late = None
    for name in ("megatron.core.export.trtllm.trtllm_helper", "megatron.core.inference.sampling_params",
                 "megatron.core.post_training.modelopt.layers", "megatron.core.hyper_comm_grid"):
        if name in sys.modules:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        if hasattr(module, "torch"):
            late = (name, module.torch is schedules.torch)
            break
    out["late_import"] = late
    before = schedules.torch
    cpu.install()
    out["idempotent"] = schedules.torch is before and cpu.installed()
    return out


def checkpoint_roundtrip(tmp: str) -> dict:
    """dist_checkpointing save + load of a tiny model on CPU (torch.cuda.synchronize et al.)."""
    import torch
    from megatron.core import dist_checkpointing

    from mnb.config import ParallelConfig
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt

    apply_layout(ParallelConfig())
    model = gpt("tiny", num_layers=2)
    chunk = model.chunks[0]
    before = {k: v.clone() for k, v in chunk.state_dict().items() if torch.is_tensor(v)}
    path = f"{tmp}/ckpt"
    import os

    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(chunk.sharded_state_dict(prefix=""), path)
    with torch.no_grad():
        for p in chunk.parameters():
            p.zero_()
    loaded = dist_checkpointing.load(chunk.sharded_state_dict(prefix=""), path)
    chunk.load_state_dict(loaded, strict=False)
    after = chunk.state_dict()
    return {"equal": all(torch.equal(before[k], after[k]) for k in before), "tensors": len(before)}


def sdpa_vs_megatron() -> dict:
    """The SDPA core attention against Megatron's DotProductAttention (causal, GQA)."""
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mnb.config import ParallelConfig, model_config
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import transformer_config
    from mnb.megatron.spec import LocalNorm, SDPAttention

    from mnb.megatron.layout import current_layout

    apply_layout(ParallelConfig())
    parallel = current_layout()
    cfg = model_config("tiny")  # 4 heads, 2 query groups: GQA
    tconfig = transformer_config(cfg, parallel)
    kwargs = dict(config=tconfig, layer_number=1, attn_mask_type=AttnMaskType.causal,
                  attention_type="self")
    ref, ours = DotProductAttention(**kwargs), SDPAttention(**kwargs)
    s, b, heads, groups, dim = 16, 2, 4, 2, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, heads, dim, generator=gen)
    k = torch.randn(s, b, groups, dim, generator=gen)
    v = torch.randn(s, b, groups, dim, generator=gen)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    expected = ref(q, k, v, mask)
    got = ours(q, k, v, None)
    sp_config = transformer_config(cfg.with_overrides(), parallel)
    sp_config.sequence_parallel = True
    norm = LocalNorm(config=sp_config, hidden_size=8)
    return {
        "shape": list(got.shape),
        "expected_shape": list(expected.shape),
        "max_abs_diff": float((got - expected).abs().max()),
        "norm_sp_flags": [bool(getattr(p, "sequence_parallel", False)) for p in norm.parameters()],
    }


def _loss_and_grad(loss_fn, logits, target):
    leaf = logits.detach().clone().requires_grad_(True)
    loss = loss_fn(leaf, target)
    # A non-uniform upstream gradient, as the loss mask and averaging give.
    weights = torch_arange_like(loss)
    (loss * weights).sum().backward()
    return loss.detach().float(), leaf.grad


def _blocked_loss(logits, target, group, ref_loss, ref_grad) -> dict:
    """The eager loss by blocks of 5 rows (the last one shorter; fusions.by_rows) against Megatron's
    loss and gradient, and against the eager loss in one block (the same values, bit for bit)."""
    import torch

    from mnb.megatron import fusions

    def ours(x, t):
        return fusions.vocab_parallel_cross_entropy(x, t, group, compiled=False)

    whole_loss, whole_grad = _loss_and_grad(ours, logits, target)
    default = fusions.EAGER_BLOCK_BYTES
    fusions.EAGER_BLOCK_BYTES = 5 * logits.shape[-1] * 4
    try:
        loss, grad = _loss_and_grad(ours, logits, target)
    finally:
        fusions.EAGER_BLOCK_BYTES = default
    return {"blocks": -(-logits.shape[0] * logits.shape[1] // 5),
            "blocked_loss_diff": float((loss - ref_loss).abs().max()),
            "blocked_grad_diff": float((grad.float() - ref_grad.float()).abs().max()),
            "blocked_equals_whole": bool(torch.equal(loss, whole_loss) and torch.equal(grad, whole_grad))}


def torch_arange_like(t):
    import torch

    return torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) / t.numel()


def fusions_vs_megatron() -> dict:
    """mnb's loss and RoPE (eager, as they run before compiling) against Megatron's own."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from mnb.config import ParallelConfig
    from mnb.megatron import fusions
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt

    apply_layout(ParallelConfig())
    gen = torch.Generator().manual_seed(3)
    out: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = (4 * torch.randn(12, 3, 512, generator=gen)).to(dtype)
        target = torch.randint(0, 512, (12, 3), generator=gen)
        ref_loss, ref_grad = _loss_and_grad(
            lambda x, t: tensor_parallel.vocab_parallel_cross_entropy(x.clone(), t), logits, target)
        loss, grad = _loss_and_grad(
            lambda x, t: fusions.vocab_parallel_cross_entropy(
                x, t, ps.get_tensor_model_parallel_group(), compiled=False), logits, target)
        name = str(dtype).split(".")[-1]
        out[f"loss_diff_{name}"] = float((loss - ref_loss).abs().max())
        out[f"grad_diff_{name}"] = float((grad.float() - ref_grad.float()).abs().max())
        out[f"grad_scale_{name}"] = float(ref_grad.float().abs().max())
        out[f"grad_dtype_{name}"] = str(grad.dtype)
        out.update({f"{k}_{name}": v for k, v in _blocked_loss(logits, target, None, ref_loss, ref_grad).items()})
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000)
    freqs = rope(12)
    t = torch.randn(12, 3, 4, 16, generator=gen)
    out["rope_diff"] = float((fusions.fused_rope(t, freqs, compiled=False) - _apply_rotary_pos_emb_bshd(t, freqs)).abs().max())
    # Through fused_rope (mnb's own backward), on a strided slice like Megatron's key.
    mixed = torch.randn(12, 3, 2, 48, generator=gen, requires_grad=True)
    key = mixed[..., 16:32]
    weights = torch.randn(12, 3, 2, 16, generator=gen)
    ours = fusions.fused_rope(key, freqs, compiled=False)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), mixed)
    theirs = _apply_rotary_pos_emb_bshd(key, freqs)
    (grad_theirs,) = torch.autograd.grad((theirs * weights).sum(), mixed)
    out["rope_strided_diff"] = float((ours - theirs).abs().max())
    out["rope_grad_diff"] = float((grad_ours - grad_theirs).abs().max())
    partial = RotaryEmbedding(kv_channels=16, rotary_percent=0.5, rotary_base=10000)(12)
    out["rope_partial_diff"] = float(
        (fusions.fused_rope(t, partial, compiled=False) - _apply_rotary_pos_emb_bshd(t, partial)).abs().max())
    x = torch.randn(6, 2, 32, generator=gen, requires_grad=True)
    gate, up = x.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up  # Megatron's unfused glu
    got = fusions.swiglu(x, compiled=False)
    out["swiglu_diff"] = float((got - expected).abs().max())
    weights = torch.randn(6, 2, 16, generator=gen)
    (g_expected,) = torch.autograd.grad((expected * weights).sum(), x)
    (g_got,) = torch.autograd.grad((got * weights).sum(), x)
    out["swiglu_grad_diff"] = float((g_got - g_expected).abs().max())
    from mnb.config import model_config
    from mnb.megatron.layout import current_layout
    from mnb.megatron.model import transformer_config
    from mnb.megatron.spec import layer_spec

    tiny = model_config("tiny")
    tconfig = transformer_config(tiny, current_layout())
    def mlp_class(spec):
        mlp = spec.submodules.mlp  # a ModuleSpec (0.16) or a partial of MLP.as_mlp_submodule (0.19)
        return (mlp.func.__self__ if hasattr(mlp, "func") else mlp.module).__name__

    out["fused_mlp"] = mlp_class(layer_spec(tiny, tconfig, use_te=False, fused=True))
    out["plain_mlp"] = mlp_class(layer_spec(tiny, tconfig, use_te=False))
    from mnb.megatron.spec import block_spec

    for name, fused in (("fused", True), ("plain", False)):
        sub = layer_spec(tiny, tconfig, use_te=False, fused=fused).submodules
        out[f"{name}_norms"] = [sub.input_layernorm.__name__, sub.pre_mlp_layernorm.__name__,
                                block_spec(tiny, tconfig, fused=fused).layer_norm.__name__]
    gelu = model_config("tiny", **GPT_STYLE)
    out["gelu_mlp"] = mlp_class(layer_spec(gelu, transformer_config(gelu, current_layout()), use_te=False,
                                           fused=True))
    # The fused MLP built through Megatron's spec machinery computes what Megatron's MLP does.
    from megatron.core.transformer.spec_utils import build_module
    from mnb.megatron.spec import _fused_mlp_class, _with_mlp_class

    plain_spec = layer_spec(tiny, tconfig, use_te=False).submodules.mlp
    fused_spec = _with_mlp_class(plain_spec, _fused_mlp_class())

    def build(spec):
        if hasattr(spec, "func"):  # 0.19: TransformerLayer calls the partial itself
            from megatron.core.process_groups_config import ProcessGroupCollection

            return spec(config=tconfig, pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                        is_mtp_layer=False)
        return build_module(spec, config=tconfig)

    torch.manual_seed(0)
    plain_mlp, fused_mlp = build(plain_spec), build(fused_spec)
    fused_mlp.load_state_dict(plain_mlp.state_dict())
    hidden = torch.randn(5, 2, tconfig.hidden_size, generator=gen)
    out["fused_mlp_diff"] = float((fused_mlp(hidden)[0] - plain_mlp(hidden)[0]).abs().max())
    try:
        gpt("tiny", fusions=True)
        out["forced_on_cpu"] = None
    except ValueError as err:
        out["forced_on_cpu"] = str(err)
    model = gpt("tiny")
    out["auto_on_cpu"] = model.fusions
    out["auto_model_class"] = type(model.chunks[0]).__name__
    out["auto_rope_fusion"] = model.transformer_config.apply_rope_fusion
    return out


def fused_first_steps() -> dict:
    """The compiled path end to end (Inductor's CPU backend): the first steps run unfused while the
    kernels compile in the background, then switch at a step boundary; the warm-up covers the real steps.

    The compile is held back (its lock) until step 2's progress event, which releases it and waits
    for it: the readiness at the end of step 2 is still "no" (decided before the event), so steps 1-3
    run unfused and 4-6 fused, whatever the machine's speed.  After that Dynamo's frame counter must
    not move through micro-batch-1 and micro-batch-2 steps.  Losses against the unfused model.
    """
    import torch._dynamo.utils as dynamo_utils

    from mnb.config import ParallelConfig
    from mnb.megatron import background_compile, events, fusions
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt
    from mnb.megatron.train import train

    fusions.COMPILE_ON_CPU = True
    apply_layout(ParallelConfig())
    fusions._warm_lock.acquire()  # the background compile waits until step 2 is done
    model = gpt("tiny")
    pending = background_compile.pending()
    seen = {}

    def release_after_step_2(kind, payload):
        if kind == "progress" and payload["step"] == 2:
            fusions._warm_lock.release()
            seen["ready"] = pending.wait(600)
            seen["calls"] = dict(fusions.calls)
            seen["frames"] = dynamo_utils.counters["frames"]["total"]

    events.set_sink(release_after_step_2)
    try:
        switched = train(model, steps=6, micro_batch_size=1, global_batch_size=2, bf16=True)
    finally:
        events.set_sink(None)
    from mnb.analysis.runs import as_run

    frames = {"after_compile": seen["frames"], "after_switch": dynamo_utils.counters["frames"]["total"]}
    calls = {k: fusions.calls[k] - seen["calls"][k] for k in fusions.calls}  # steps 3-6, the main thread only
    losses = {"switched": _losses(switched)}
    record = train(model, steps=1, micro_batch_size=2, global_batch_size=2, bf16=True)
    frames["after_mbs2"] = dynamo_utils.counters["frames"]["total"]
    losses["fused_mbs2"] = _losses(record)[0]
    fusions.COMPILE_ON_CPU = False
    apply_layout(ParallelConfig(tp=1))
    plain = gpt("tiny", fusions=False)
    losses["plain"] = _losses(train(plain, steps=6, micro_batch_size=1, global_batch_size=2, bf16=True))
    losses["plain_mbs2"] = _losses(train(plain, steps=1, micro_batch_size=2, global_batch_size=2, bf16=True))[0]
    return {"frames": frames, "losses": losses, "fused_class": type(model.chunks[0]).__name__,
            "rope_fusion": model.transformer_config.apply_rope_fusion, "ready": seen["ready"], "calls": calls,
            "compiling": [row["compiling"] for row in switched["steps"]],
            "summary": str(as_run([dict(switched)]).summary())}


def fused_relayout() -> dict:
    """Compiled path on 2 CPU ranks: a tp1 model, then tp2; nothing compiles after the first gpt's warm-up."""
    import torch._dynamo.utils as dynamo_utils

    from mnb.config import ParallelConfig
    from mnb.megatron import background_compile, fusions
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt
    from mnb.megatron.train import train

    fusions.COMPILE_ON_CPU = True
    frames, losses = {}, {}
    for name, layout in (("tp1", ParallelConfig()), ("tp2", ParallelConfig(tp=2))):
        apply_layout(layout)
        model = gpt("tiny")
        if background_compile.pending() is not None:  # the first gpt compiles in the background
            background_compile.pending().wait()
        frames[f"{name}_after_gpt"] = dynamo_utils.counters["frames"]["total"]
        losses[name] = _losses(train(model, steps=1, micro_batch_size=1, global_batch_size=2, bf16=True))[0]
        frames[f"{name}_after_step"] = dynamo_utils.counters["frames"]["total"]
    return {"frames": frames, "losses": losses}


def continue_training() -> dict:
    from mnb.config import ParallelConfig
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt
    from mnb.megatron.train import train

    apply_layout(ParallelConfig())
    model = gpt("tiny", num_layers=2)
    first = train(model, steps=3, **PARITY_BATCH)
    second = train(model, steps=3, **PARITY_BATCH)
    once = train(gpt("tiny", num_layers=2), steps=6, **PARITY_BATCH)
    return {
        "split": _losses(first) + _losses(second),
        "once": _losses(once),
        "second_steps": [row["step"] for row in second["steps"]],
        "repr": repr(second), "losses_key": second["losses"], "lrs": second.lrs, "type": type(second).__name__,
    }


def events_seen() -> dict:
    from mnb.megatron import events

    seen = []
    events.take_records()
    events.set_sink(lambda kind, payload: seen.append((kind, payload)))
    try:
        record = _train("tiny", {}, gpt_kw=dict(num_layers=2), steps=2)
    finally:
        events.set_sink(None)
    taken = events.take_records()
    return {
        "kinds": [kind for kind, _ in seen],
        "progress": [payload for kind, payload in seen if kind == "progress"],
        "taken": len(taken),
        "taken_is_record": bool(taken) and taken[0] == record,
        "record": record,
    }


def oom_message() -> dict:
    import torch

    from mnb.config import ParallelConfig
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt
    from mnb.megatron.train import train

    apply_layout(ParallelConfig())
    model = gpt("tiny", num_layers=1)

    def explode(module, args, output):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    model.chunks[0].decoder.layers[0].register_forward_hook(explode)
    try:
        train(model, steps=1, **PARITY_BATCH)
    except torch.OutOfMemoryError as err:
        return {"type": type(err).__name__, "message": str(err),
                "cause": type(err.__cause__).__name__}
    return {"type": None}


# ---------------------------------------------------------------- world size 2


def world2() -> dict:
    results: dict = {}
    _guard(results, "layout_walk", layout_walk)
    _guard(results, "fused-loss-tp2", fused_loss_tp2)
    for name, (reference, parallel_kw, train_kw) in WORLD2_LAYOUTS.items():
        preset, gpt_kw = REFERENCES[reference]
        _guard(results, name, lambda: _train(preset, parallel_kw, gpt_kw, **train_kw))
    _guard(results, "tp2-sp-wgrad-fused", wgrad_fused)
    return results


def wgrad_fused() -> dict:
    """tp2 + sp with the weight gradients added into main_grad by the GEMM (mnb.megatron.wgrad_fusion, forced
    on for CPU ranks): its losses, how often the kernels ran, and whether the switch is off afterwards."""
    from mnb.megatron import wgrad_fusion

    wgrad_fusion.ON_CPU = True
    wgrad_fusion.calls.update(fp32=0, same_dtype=0)
    from mnb.config import ParallelConfig
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt
    from mnb.megatron.train import train

    apply_layout(ParallelConfig(tp=2, sequence_parallel=True))
    model = gpt("tiny")
    try:
        record = train(model, steps=PARITY_STEPS, **PARITY_BATCH)
    finally:
        wgrad_fusion.ON_CPU = False
    left_on = sum(getattr(m, "gradient_accumulation_fusion", False) is True
                  for chunk in model.chunks for m in chunk.modules())
    return {"steps": record["steps"], "calls": dict(wgrad_fusion.calls), "left_on": left_on}


def fused_loss_tp2() -> dict:
    """mnb's vocab-parallel loss against Megatron's with the vocabulary split over tp=2."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from mnb.config import ParallelConfig
    from mnb.megatron import fusions
    from mnb.megatron.layout import apply_layout

    apply_layout(ParallelConfig(tp=2))
    gen = torch.Generator().manual_seed(5)
    full = 4 * torch.randn(10, 2, 256, generator=gen)
    target = torch.randint(0, 256, (10, 2), generator=gen)
    rank = ps.get_tensor_model_parallel_rank()
    part = full[..., rank * 128:(rank + 1) * 128].contiguous()
    group = ps.get_tensor_model_parallel_group()
    ref_loss, ref_grad = _loss_and_grad(
        lambda x, t: tensor_parallel.vocab_parallel_cross_entropy(x.clone(), t), part, target)
    loss, grad = _loss_and_grad(
        lambda x, t: fusions.vocab_parallel_cross_entropy(x, t, group, compiled=False), part, target)
    unsplit = torch.nn.functional.cross_entropy(full.reshape(-1, 256), target.reshape(-1),
                                                reduction="none").reshape(10, 2)
    return {"loss_diff": float((loss - ref_loss).abs().max()),
            "grad_diff": float((grad.float() - ref_grad.float()).abs().max()),
            "unsplit_diff": float((loss - unsplit).abs().max()),
            **_blocked_loss(part, target, group, ref_loss, ref_grad)}


def layout_walk() -> list:
    import torch

    from mnb.config import ParallelConfig
    from mnb.megatron.layout import apply_layout, coordinates, current_layout
    from mnb.megatron.model import gpt
    from mnb.megatron.train import train

    walk = [{"request": None, "rebuilt": None, "layout": None, "coords": coordinates()}]

    def step(**kw):
        rebuilt = apply_layout(ParallelConfig(**kw))
        layout = current_layout()
        walk.append({"request": kw, "rebuilt": rebuilt, "layout": layout.as_dict(),
                     "coords": coordinates()})

    step(tp=2)
    model = gpt("tiny", num_layers=2)
    step(tp=2)
    step(tp=2, sequence_parallel=True)
    step(pp=2)
    try:
        train(model, steps=1, **PARITY_BATCH)
        walk.append({"stale_model": None})
    except RuntimeError as err:
        walk.append({"stale_model": str(err)})
    step()
    try:  # a save says the same, naming the change that released it, not the latest (user trial 12-05)
        from mnb.megatron.checkpoint import save

        save("/nonexistent/never-written", model)
        walk[-1]["stale_save"] = None
    except RuntimeError as err:
        walk[-1]["stale_save"] = str(err)
    step(ep=2)
    for bad in (dict(tp=3), dict(cp=4)):  # cp itself runs without TE (test_context_parallel.py)
        try:
            apply_layout(ParallelConfig(**bad))
            walk.append({"bad": bad, "error": None})
        except ValueError as err:
            walk.append({"bad": bad, "error": str(err)})
    walk.append({"after_bad": current_layout().as_dict(), "rank": torch.distributed.get_rank()})
    return walk


class LiveTensorBytes:
    """The bytes of tensor storages alive at once while the block runs, counted as ops make them and as
    they are freed (a ``TorchDispatchMode``; storages told apart by data pointer, views counted once).
    ``peak_bytes`` is the most held at once of what the block allocated (what existed before is not counted)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter._note(out, (args, kwargs))
                return out

        self._mode = _Mode()
        self.now_bytes = self.peak_bytes = 0
        self._alive: dict[int, int] = {}

    def _note(self, out, inputs) -> None:
        import weakref

        import torch
        from torch.utils._pytree import tree_flatten

        given = {t.untyped_storage().data_ptr() for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if not ptr or ptr in self._alive or ptr in given:  # a view or an in-place op's output: not new
                continue
            self._alive[ptr] = storage.nbytes()
            self.now_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.now_bytes)
            weakref.finalize(storage, self._freed, ptr)

    def _freed(self, ptr: int) -> None:
        self.now_bytes -= self._alive.pop(ptr, 0)

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def unfused_step_memory(block_share: int = 32) -> dict:
    """A fused model's training step while its kernels compile (the ranks hold the compile's lock, so it
    never finishes): every tensor the step makes counted as it is made and freed, against the step's part
    of ``mnb.estimate.memory`` (activations, logits and the allocator's overhead; the weights, gradients
    and optimizer state exist before the step and are checked exactly by test_memory.py).

    The eager ops work on blocks of ``1/block_share`` of the loss's fp32 logits, as the default
    ``EAGER_BLOCK_BYTES`` is to llama-3b's at micro batch 8, seq 2048 (256 MiB of 8.4 GB: 1/32).
    Step 1 runs first (Adam's moments are made there); step 2 is counted, as the step that ran out
    of memory on the GPU (issue 39).  fp32 training: CPU ranks' norms keep fp32 copies under bf16,
    which the estimate counts for fp32 only (activations.norm_extra_bytes).
    """
    import mnb.estimate as est
    from mnb.config import ParallelConfig, TrainConfig
    from mnb.megatron import background_compile, fusions
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt
    from mnb.megatron.train import train

    fusions.COMPILE_ON_CPU = True
    apply_layout(ParallelConfig())
    fusions._warm_lock.acquire()  # the background compile never starts: every step runs unfused
    batch = dict(micro_batch_size=8, global_batch_size=8)
    model = gpt("tiny", vocab_size=2048, seq_length=128)
    pending = background_compile.pending()
    vocab = model.padded_vocab_size
    tokens = batch["micro_batch_size"] * 128
    fusions.EAGER_BLOCK_BYTES = tokens * vocab * 4 // block_share
    first = train(model, steps=1, **batch)
    with LiveTensorBytes() as live:
        second = train(model, steps=1, **batch)
    stage = est.memory(model.config, ParallelConfig(), TrainConfig(**batch), gpus=1, fused_loss=True,
                       fused_kernels=True, cpu_kernels=True).stages[0]
    return {"compiling": [row["compiling"] for row in first["steps"] + second["steps"]],
            "compile_pending": pending is not None and not pending.ready,
            "model_class": type(model.chunks[0]).__name__,
            "eager_calls": fusions.calls["eager"], "compiled_calls": fusions.calls["compiled"],
            "step_peak_bytes": live.peak_bytes,
            "estimate_step_bytes": stage.activations_bytes + stage.logits_bytes + stage.other_bytes,
            "estimate_logits_bytes": stage.logits_bytes, "estimate_activations_bytes": stage.activations_bytes}


def decode_kernels_interpreted() -> dict:
    """mnb's Triton decode kernels under Triton's interpreter (the launch sets TRITON_INTERPRET=1) on 2 CPU
    ranks: each kernel against torch on cases of its own (rank 0), then ``mnb.generate``'s decode step with
    them (graphs replaced by plain calls) against the per-token path, under dp2, tp2, pp2 and tp2 with LoRA."""
    import math

    import torch
    import torch.nn.functional as F

    from mnb.config import ParallelConfig
    from mnb.megatron import decode_graphs, decode_kernels
    from mnb.megatron.generate import generate
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt

    results: dict = {"runs_on_cpu": decode_kernels.runs_on(torch.device("cpu"))}
    cases = {  # name -> rows, heads, groups, dim, positions, each row's new position
        "llama-groups-4-blocks": (1, 8, 2, 64, 256, [200]),
        "one-head-a-group-dim-48-first-position": (3, 4, 4, 48, 256, [5, 63, 0]),
        "last-position": (2, 6, 3, 32, 512, [130, 511]),
    }

    def attention_cases():
        out = {}
        for name, (rows, heads, groups, dim, positions, where) in cases.items():
            for dtype in (torch.float32, torch.bfloat16):
                gen = torch.Generator().manual_seed(rows * 100 + dim)
                keys = torch.randn(rows, groups, positions, dim, generator=gen).to(dtype)
                values = torch.randn(rows, groups, positions, dim, generator=gen).to(dtype)
                qk = torch.randn(1, rows, heads + groups, dim, generator=gen).to(dtype)  # strided, as after RoPE
                query, key = qk[:, :, :heads], qk[:, :, heads:]
                value = torch.randn(1, rows, groups, dim, generator=gen).to(dtype)
                at = torch.tensor(where).view(rows, 1)
                bias = torch.where(torch.arange(positions) <= at, 0.0, float("-inf")).view(rows, 1, 1, -1)
                scale = 1 / math.sqrt(dim)
                eager_keys, eager_values = keys.clone(), values.clone()
                exact = decode_graphs.decode_attention(query.float(), key.float(), value.float(), keys.float(),
                                                       values.float(), at, bias, scale)
                decode_graphs.decode_attention(query, key, value, eager_keys, eager_values, at, bias, scale)
                got = decode_kernels.decode_attention(query, key, value, keys, values, at, bias, scale)
                out[f"{name}-{str(dtype)[6:]}"] = dict(
                    shape=list(got.shape), dtype=str(got.dtype),
                    error=float((got.float() - exact).abs().max()),
                    relative=float(((got.float() - exact).abs() / (exact.abs() + 1e-6)).max()),
                    cache_written=torch.equal(keys, eager_keys) and torch.equal(values, eager_values))
        x = torch.randn(3, 2, 300, generator=torch.Generator().manual_seed(0))
        w = torch.randn(300, generator=torch.Generator().manual_seed(1))
        out["rms_norm-float32"] = dict(error=float((decode_kernels.rms_norm(x, w, 1e-5)
                                                    - F.rms_norm(x, (300,), w, 1e-5)).abs().max()))
        x16, w16 = x.to(torch.bfloat16), w.to(torch.bfloat16)
        exact = F.rms_norm(x16.float(), (300,), w16.float(), 1e-5)
        got = decode_kernels.rms_norm(x16, w16, 1e-5)
        out["rms_norm-bfloat16"] = dict(dtype=str(got.dtype), relative=float(
            ((got.float() - exact).abs() / (exact.abs() + 1e-6)).max()))
        # a last block of 5 rows; no bias; 2,500 columns (three loop steps) of a weight whose rows are 3,000 apart
        for rows, bias, width, stride in ((37, True, 300, 300), (64, False, 300, 300), (24, True, 2500, 3000)):
            gen = torch.Generator().manual_seed(rows)
            x = torch.randn(1, 1, width, generator=gen).to(torch.bfloat16)
            w = torch.randn(rows, stride, generator=gen).to(torch.bfloat16)[:, :width]
            b = torch.randn(rows, generator=gen).to(torch.bfloat16) if bias else None
            exact = F.linear(x.float(), w.float(), None if b is None else b.float())
            got = decode_kernels.linear(x, w, b)
            out[f"linear-{rows}"] = dict(shape=list(got.shape), dtype=str(got.dtype),
                                         one_row=decode_kernels.one_row(x, w, b),
                                         excess=float(((got.float() - exact).abs() - exact.abs() * 2 ** -7).max()))
        out["one_row-refuses"] = [decode_kernels.one_row(torch.zeros(2, 300, dtype=torch.bfloat16),
                                                         torch.zeros(8, 300, dtype=torch.bfloat16)),
                                  decode_kernels.one_row(torch.zeros(1, 300), torch.zeros(8, 300))]
        # a kernel that fails its probe (Triton without a C compiler, an unsupported GPU): torch's ops serve
        kept = decode_kernels.linear
        decode_kernels.linear = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("cannot build (test)"))
        decode_kernels._probe.cache_clear()
        try:
            out["probe_refuses"] = decode_kernels.runs_on(torch.device("cpu"))
        finally:
            decode_kernels.linear = kept
            decode_kernels._probe.cache_clear()
        out["probe_passes"] = decode_kernels.runs_on(torch.device("cpu"))
        return out

    if torch.distributed.get_rank() == 0:
        _guard(results, "kernels", attention_cases)

    calls = {"attention": 0, "rms_norm": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    decode_kernels.decode_attention = counted("attention", decode_kernels.decode_attention)
    decode_kernels.rms_norm = counted("rms_norm", decode_kernels.rms_norm)
    decode_kernels.linear = counted("linear", decode_kernels.linear)
    calls["linear"] = 0
    prompts = [[5, 17, 33, 2, 90, 41, 7], [300, 12], [64, 65, 66, 67]]

    def layout_run(parallel, adapted=False):
        def run():
            apply_layout(parallel)
            model = gpt("tiny")
            if adapted:  # LoRA on every linear, trained a little so that its B is not zero
                from mnb.megatron.lora import lora
                from mnb.megatron.train import train

                lora(model, rank=4, alpha=8, targets="all-linear")
                train(model, steps=2, micro_batch_size=1, global_batch_size=2, lr=1e-2)
            decode_graphs.cpu_standin = False
            per_token = generate(model, prompts, max_new_tokens=12, stream=False)
            decode_graphs.cpu_standin = True
            before = dict(calls)
            try:
                static = generate(model, prompts, max_new_tokens=12, stream=False)
            finally:
                decode_graphs.cpu_standin = False
            return dict(equal=static == per_token, kernels=model.decoder.kernels,
                        calls={k: calls[k] - before[k] for k in calls})
        return run

    for name, parallel in (("dp2", ParallelConfig()), ("tp2", ParallelConfig(tp=2)), ("pp2", ParallelConfig(pp=2))):
        _guard(results, name, layout_run(parallel))
    _guard(results, "tp2-lora", layout_run(ParallelConfig(tp=2), adapted=True))
    apply_layout(ParallelConfig(tp=2))

    def one_row_bf16():  # batch 1 in bf16: the linears of every decode step through decode_kernels.linear
        model = gpt("tiny")
        for chunk in model.chunks:
            chunk.bfloat16()
        decode_graphs.cpu_standin = True
        before = dict(calls)
        try:
            tokens = generate(model, [prompts[0]], max_new_tokens=6, stream=False)
        finally:
            decode_graphs.cpu_standin = False
        return dict(tokens=len(tokens[0]), calls={k: calls[k] - before[k] for k in calls})

    _guard(results, "tp2-bf16-batch1", one_row_bf16)
    return results


def _tp2_sp_training(kernels, build, width: int | None = None) -> dict:
    """``build()``'s model (tiny, seeded) trained 3 parity steps under tp2 + sequence parallelism: its losses,
    gradient norms and the calls of the kernel module ``kernels`` (its probe run first, outside the count; at
    ``width`` for a module that probes per width)."""
    import torch

    from mnb.config import ParallelConfig
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.train import train

    apply_layout(ParallelConfig(tp=2, sequence_parallel=True))
    torch.manual_seed(0)
    model = build()
    kernels.runs_on(torch.device("cpu"), *(() if width is None else (width,)))
    before = dict(kernels.calls)
    record = train(model, steps=3, **PARITY_BATCH)
    return dict(losses=_losses(record), grad_norms=[row["grad_norm"] for row in record["steps"]],
                calls={k: kernels.calls[k] - before[k] for k in before})


def _refusals(kernels, applies) -> dict:
    """``applies()`` with the kernel module ``kernels`` switched off, and with its kernels failing their probe
    (Triton without a C compiler, an unsupported GPU); both restored after."""
    out = {}
    kernels.enabled = False
    try:
        out["enabled = False"] = applies()
    finally:
        kernels.enabled = True
    attribute = "_kernels" if hasattr(kernels, "_kernels") else "_kernel"
    kept = getattr(kernels, attribute)
    setattr(kernels, attribute, lambda: (_ for _ in ()).throw(RuntimeError("cannot build (test)")))
    kernels._probe.cache_clear()
    try:
        out["probe fails"] = applies()
    finally:
        setattr(kernels, attribute, kept)
        kernels._probe.cache_clear()
    return out


def norm_kernels_interpreted() -> dict:
    """mnb's RMSNorm kernels (mnb.megatron.norm_kernels) under Triton's interpreter on 2 CPU ranks: forward and
    backward against ``F.rms_norm``'s autograd on cases of their own, and the rule for when they apply (rank 0);
    then tiny trained under tp2 + sp with every norm through them against the same run with torch's norms."""
    import torch
    import torch.nn.functional as F

    from mnb.config import ParallelConfig
    from mnb.megatron import norm_kernels
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt
    from mnb.megatron.spec import LocalNorm

    results: dict = {}

    def cases():
        out = {}
        # rows, width, the input's layout, the backward's tile: rows 3 rows apart (a strided view); 2,500
        # columns (not a power of two, a block of 4,096: the forward's tiles of 8,192 elements are 2 rows, the
        # last of 21 short), the backward a row at a time (4 programs of 6, 6, 6 and 3 rows) and in tiles of
        # 2 rows (4 programs of 3, 3, 3 and 2 tiles, the last short); a 3-D [s, b, h] input as Megatron's
        # layers pass it
        for rows, width, shape, backward_tile in ((37, 48, "strided", 1), (21, 2500, "rows", 1),
                                                  (21, 2500, "tiles", 8192), (64, 16, "sbh", 1)):
            norm_kernels.BACKWARD_TILE = backward_tile
            for dtype in (torch.float32, torch.bfloat16):
                gen = torch.Generator().manual_seed(rows)
                if shape == "strided":
                    x = torch.randn(rows, 3, width, generator=gen).to(dtype)[:, 1]
                elif shape == "sbh":
                    x = torch.randn(rows // 4, 4, width, generator=gen).to(dtype)
                else:
                    x = torch.randn(rows, width, generator=gen).to(dtype)
                w = (1 + 0.3 * torch.randn(width, generator=gen)).to(dtype)
                dy = torch.randn(x.shape, generator=gen).to(dtype)
                exact_x = x.detach().float().clone().requires_grad_()
                exact_w = w.detach().float().clone().requires_grad_()
                F.rms_norm(exact_x, (width,), exact_w, 1e-5).backward(dy.float())
                exact_y = F.rms_norm(x.float(), (width,), w.float(), 1e-5)
                got_x, got_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
                before = dict(norm_kernels.calls)
                got_y = norm_kernels.rms_norm(got_x, got_w, 1e-5)
                got_y.backward(dy)

                def relative(got, exact):  # against the largest value: bf16 rounds each to 8 bits
                    return float((got.float() - exact).abs().max() / exact.abs().max())

                out[f"{shape}-{rows}x{width}-{str(dtype)[6:]}"] = dict(
                    y=relative(got_y, exact_y), dx=relative(got_x.grad, exact_x.grad),
                    dw=relative(got_w.grad, exact_w.grad),
                    dtypes=[str(t.dtype)[6:] for t in (got_y, got_x.grad, got_w.grad)],
                    shape=list(got_y.shape) == list(x.shape),
                    calls={k: norm_kernels.calls[k] - before[k] for k in before})
        norm_kernels.BACKWARD_TILE = 1
        # the weight frozen (an adapter run): no weight gradient, the input's still exact
        x = torch.randn(6, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
        w = torch.rand(32, generator=torch.Generator().manual_seed(4)) + 0.5
        norm_kernels.rms_norm(x, w, 1e-6).sum().backward()
        exact = x.detach().clone().requires_grad_()
        F.rms_norm(exact, (32,), w, 1e-6).sum().backward()
        out["frozen-weight"] = dict(dx=float((x.grad - exact.grad).abs().max()))
        cpu = torch.zeros(4, 32)
        weight = torch.ones(32)
        out["applies"] = norm_kernels.applies(cpu, weight)
        out["refuses"] = {
            "no weight": norm_kernels.applies(cpu, None),
            "wider than MAX_WIDTH": norm_kernels.applies(torch.zeros(2, norm_kernels.MAX_WIDTH + 1),
                                                         torch.ones(norm_kernels.MAX_WIDTH + 1)),
            "integers": norm_kernels.applies(cpu.long(), weight),
            "weight of another width": norm_kernels.applies(cpu, torch.ones(16)),
            "empty": norm_kernels.applies(torch.zeros(0, 32), weight),
        }
        # switched off, or a kernel that fails its probe (Triton without a C compiler, an unsupported GPU): torch's
        # norm serves
        out["refuses"].update(_refusals(norm_kernels, lambda: norm_kernels.applies(cpu, weight)))
        with torch.no_grad():  # a first norm under no_grad (mnb.generate, activation recompute) probes the backward too
            out["applies_after_probe"] = norm_kernels.applies(cpu, weight)
        # a first norm inside non-reentrant checkpointing: the probe's tensors stay out of its saved-tensor hooks
        norm_kernels._probe.cache_clear()
        x = torch.randn(4, 32, requires_grad=True)

        def checkpointed(t):
            if not norm_kernels.applies(t, weight):
                raise AssertionError("the probe failed inside checkpointing")
            return norm_kernels.rms_norm(t, weight, 1e-5)

        torch.utils.checkpoint.checkpoint(checkpointed, x, use_reentrant=False).sum().backward()
        out["checkpointed"] = x.grad is not None and norm_kernels.applies(cpu, weight)
        y = norm_kernels.rms_norm(x, weight, 1e-5)
        y.mul_(2)  # its own tensor, not a view: written in place as torch's norm's output can be
        out["written_in_place"] = y._base is None
        return out

    if torch.distributed.get_rank() == 0:
        _guard(results, "kernels", cases)

    def train_with(own_kernels: bool):
        def run():
            LocalNorm.own_kernels = own_kernels  # every norm of the model, as FusedLocalNorm on a GPU rank
            try:
                return _tp2_sp_training(norm_kernels, lambda: gpt("tiny"), width=64)  # tiny's hidden size
            finally:
                LocalNorm.own_kernels = False
        return run

    _guard(results, "tp2-sp-torch", train_with(False))
    _guard(results, "tp2-sp-kernels", train_with(True))

    def decode_with_and_without_own_kernels():
        """mnb.generate of a model built as a GPU rank builds it (norms with mnb's kernels, fused MLPs), with
        decode_graphs.own_kernels off (no mnb kernel at all: torch's norms, the eager fused SwiGLU) and on
        (graphs replaced by plain calls on CPU)."""
        from mnb.megatron import decode_graphs, swiglu_kernels
        from mnb.megatron.generate import generate
        from mnb.megatron.spec import _fused_mlp_class

        out = {}
        LocalNorm.own_kernels = True
        try:
            apply_layout(ParallelConfig())
            model = gpt("tiny")
            for chunk in model.chunks:
                for layer in chunk.decoder.layers:
                    layer.mlp.__class__ = _fused_mlp_class()
            for own in (False, True):
                decode_graphs.own_kernels, decode_graphs.cpu_standin = own, True
                before = (dict(norm_kernels.calls), dict(swiglu_kernels.calls))
                try:
                    tokens = generate(model, [[5, 17, 33, 2]], max_new_tokens=4, stream=False)
                finally:
                    decode_graphs.own_kernels, decode_graphs.cpu_standin = True, False
                out["on" if own else "off"] = dict(
                    tokens=tokens, kernels=model.decoder.kernels,
                    norm_calls=norm_kernels.calls["forward"] - before[0]["forward"],
                    swiglu_calls=swiglu_kernels.calls["forward"] - before[1]["forward"])
                model.decoder = None  # the next generate builds its decoder anew, with the other setting
        finally:
            LocalNorm.own_kernels = False
        return out

    _guard(results, "decode-own-kernels", decode_with_and_without_own_kernels)
    return results


def swiglu_kernels_interpreted() -> dict:
    """mnb's SwiGLU kernels (mnb.megatron.swiglu_kernels) under Triton's interpreter on 2 CPU ranks: forward and
    backward against the compiled kernel's arithmetic (``fusions._swiglu`` / ``_swiglu_grad`` in fp32) on cases
    of their own, the rule for when they apply and ``fusions.swiglu``'s routing (rank 0); then tiny trained
    under tp2 + sp with its MLPs fused, the SwiGLU in the kernels against the same run without them."""
    import torch

    from mnb.megatron import fusions, swiglu_kernels
    from mnb.megatron.model import gpt
    from mnb.megatron.spec import _fused_mlp_class

    results: dict = {}

    def cases():
        out = {}
        # rows, width of each half, layout: 1,500 columns (a full block and a partial one), rows 3 apart, [s, b, 2f]
        for rows, width, shape in ((37, 88, "rows"), (5, 1500, "strided"), (12, 64, "sbh")):
            for dtype in (torch.float32, torch.bfloat16):
                gen = torch.Generator().manual_seed(rows + width)
                if shape == "strided":
                    x = (torch.randn(rows, 3, 2 * width, generator=gen) * 3).to(dtype)[:, 1]
                elif shape == "sbh":
                    x = (torch.randn(rows // 4, 4, 2 * width, generator=gen) * 3).to(dtype)
                else:
                    x = (torch.randn(rows, 2 * width, generator=gen) * 3).to(dtype)
                g = torch.randn(*x.shape[:-1], width, generator=gen).to(dtype)
                exact = fusions._swiglu(x.float())
                exact_grad = fusions._swiglu_grad(g.float(), x.float())
                got_x = x.detach().clone().requires_grad_()
                before = dict(swiglu_kernels.calls)
                got = swiglu_kernels.swiglu(got_x)
                got.backward(g)

                def relative(a, b):
                    return float((a.float() - b).abs().max() / b.abs().max())

                out[f"{shape}-{rows}x{width}-{str(dtype)[6:]}"] = dict(
                    out=relative(got, exact), grad=relative(got_x.grad, exact_grad),
                    dtypes=[str(t.dtype)[6:] for t in (got, got_x.grad)],
                    shapes=[list(got.shape) == list(exact.shape), list(got_x.grad.shape) == list(x.shape)],
                    calls={k: swiglu_kernels.calls[k] - before[k] for k in before})
        x = torch.randn(6, 32)
        out["applies"] = swiglu_kernels.applies(x)
        out["refuses"] = {"odd width": swiglu_kernels.applies(torch.randn(6, 31)),
                          "integers": swiglu_kernels.applies(x.long()),
                          "empty": swiglu_kernels.applies(torch.zeros(0, 32)),
                          **_refusals(swiglu_kernels, lambda: swiglu_kernels.applies(x))}
        # fusions.swiglu: the kernels by default; an explicit compiled= (the warm-up's, a test's) keeps its own path
        swiglu_kernels.runs_on(torch.device("cpu"))  # probed again (its cache was cleared), before the count
        before = (dict(swiglu_kernels.calls), dict(fusions.calls))
        fusions.swiglu(x)
        fusions.swiglu(x, compiled=False)
        out["routed"] = [swiglu_kernels.calls["forward"] - before[0]["forward"],
                         fusions.calls["eager"] - before[1]["eager"]]
        return out

    if torch.distributed.get_rank() == 0:
        _guard(results, "kernels", cases)

    def with_fused_mlps():
        model = gpt("tiny")
        for chunk in model.chunks:  # the MLP a GPU rank builds (FusedSwiGLUMLP: only its forward differs)
            for layer in chunk.decoder.layers:
                layer.mlp.__class__ = _fused_mlp_class()
        return model

    def train_with(kernels: bool):
        def run():
            swiglu_kernels.enabled = kernels
            try:
                return _tp2_sp_training(swiglu_kernels, with_fused_mlps)
            finally:
                swiglu_kernels.enabled = True
        return run

    _guard(results, "tp2-sp-eager", train_with(False))
    _guard(results, "tp2-sp-kernels", train_with(True))
    return results


def rope_kernels_interpreted() -> dict:
    """mnb's RoPE kernel (mnb.megatron.rope_kernels) under Triton's interpreter, rank 0: forward and backward
    against the compiled kernel's arithmetic (``fusions._rope`` / ``_rope_grad`` in fp32); Megatron's query and
    key views of the fused QKV through ``fusions.fused_rope`` against Megatron's own unfused RoPE; the rule for
    when it applies and ``fused_rope``'s routing."""
    import torch
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from mnb.megatron import fusions, rope_kernels

    results: dict = {}

    def relative(a, b):
        return float((a.float() - b).abs().max() / b.abs().max())

    def cases():
        out = {}
        rope_kernels.runs_on(torch.device("cpu"))  # its probe (a forward and backward per dtype), outside the counts
        # positions, heads, width, rotated columns: heads not a multiple of a program's block, a partial
        # rotation (columns from rot on pass through), a strided view of heads
        for positions, heads, width, rot, shape in ((7, 6, 16, 16, "rows"), (5, 9, 24, 8, "partial"),
                                                    (4, 5, 32, 32, "strided")):
            for dtype in (torch.float32, torch.bfloat16):
                gen = torch.Generator().manual_seed(positions * heads)
                if shape == "strided":
                    t = torch.randn(positions, 2 * heads, width, generator=gen).to(dtype)[:, ::2]
                else:
                    t = torch.randn(positions, heads, width, generator=gen).to(dtype)
                freqs = torch.randn(positions, 1, rot, generator=gen) * 3
                cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
                g = torch.randn(positions, heads, width, generator=gen).to(dtype)
                exact = fusions._rope(t.float(), cos.float(), sin.float())
                exact_grad = fusions._rope_grad(g.float(), cos.float(), sin.float())
                got_t = t.detach().clone().requires_grad_() if shape != "strided" else t.detach().requires_grad_()
                before = dict(rope_kernels.calls)
                got = rope_kernels.rope(got_t, cos, sin)
                got.backward(g)
                out[f"{shape}-{positions}x{heads}x{width}-{str(dtype)[6:]}"] = dict(
                    out=relative(got, exact), grad=relative(got_t.grad, exact_grad),
                    dtypes=[str(x.dtype)[6:] for x in (got, got_t.grad)],
                    contiguous=got.is_contiguous(), shape=list(got.shape) == list(t.shape),
                    calls={k: rope_kernels.calls[k] - before[k] for k in before})
        # Megatron's layout: the fused QKV [s, b, groups * (heads/group + 2) * head] viewed and split, the
        # query reshaped, RoPE through fusions.fused_rope (Megatron's fused slot) against Megatron's unfused
        # two layouts: 2 groups of 3 query heads at micro batch 2; micro batch 1 with one group of one head (the
        # key is then one head: [s, 1, 1, d]) and half of the head rotated
        for name, (seq, batch, groups, per_group, head, rot) in {"megatron_views": (6, 2, 2, 3, 16, 16),
                                                                 "megatron_views_one_head": (5, 1, 1, 1, 32, 16)}.items():
            gen = torch.Generator().manual_seed(11)
            mixed = torch.randn(seq, batch, groups * (per_group + 2) * head, generator=gen, requires_grad=True)
            query, key, _ = mixed.view(seq, batch, groups, (per_group + 2) * head).split(
                [per_group * head, head, head], dim=3)
            query = query.reshape(seq, batch, -1, head)
            freqs = torch.randn(seq, 1, 1, rot, generator=gen)
            rope_kernels.runs_on(torch.device("cpu"), head)  # this width's probe, outside the counts
            before = dict(rope_kernels.calls)
            ours = [fusions.fused_rope(x, freqs) for x in (query, key)]
            theirs = [_apply_rotary_pos_emb_bshd(x, freqs) for x in (query, key)]
            grads = []
            for rotated in (ours, theirs):
                mixed.grad = None
                sum((r * torch.arange(r.numel()).view(r.shape).sin()).sum() for r in rotated).backward()
                grads.append(mixed.grad.clone())
            out[name] = dict(out=max(relative(a, b) for a, b in zip(ours, theirs)), grad=relative(grads[0], grads[1]),
                             calls={k: rope_kernels.calls[k] - before[k] for k in before})
        t, table = torch.randn(4, 3, 16), torch.randn(4, 1, 16)
        out["applies"] = rope_kernels.applies(t, table)
        out["refuses"] = {"odd rotation": rope_kernels.applies(t, torch.randn(4, 1, 15)),
                          "rotation wider than the head": rope_kernels.applies(t, torch.randn(4, 1, 32)),
                          "a table row for every position": rope_kernels.applies(t, torch.randn(1, 1, 16)),
                          "integers": rope_kernels.applies(t.long(), table),
                          "empty": rope_kernels.applies(torch.zeros(0, 3, 16), torch.zeros(0, 1, 16)),
                          **_refusals(rope_kernels, lambda: rope_kernels.applies(t, table))}
        rope_kernels.runs_on(torch.device("cpu"), 16)  # probed again (its cache was cleared), before the count
        before = (dict(rope_kernels.calls), dict(fusions.calls))
        four = torch.randn(4, 1, 3, 16)
        fusions.fused_rope(four, torch.randn(4, 1, 1, 16))
        fusions.fused_rope(four, torch.randn(4, 1, 1, 16), compiled=False)
        out["routed"] = [rope_kernels.calls["forward"] - before[0]["forward"],
                         fusions.calls["eager"] - before[1]["eager"]]
        return out

    if torch.distributed.get_rank() == 0:
        _guard(results, "kernels", cases)
    return results


def loss_kernels_interpreted() -> dict:
    """mnb's cross-entropy kernels (mnb.megatron.loss_kernels) under Triton's interpreter on 2 CPU ranks: on
    rank 0, the loss and its gradient against the compiled loss's arithmetic (``fusions.vocab_parallel_cross_
    entropy`` run eagerly, fp32) and torch's ``cross_entropy``, the rule for when they apply and the routing;
    then on both ranks a vocabulary split over a tp group of 2 against the whole vocabulary's loss."""
    import torch
    import torch.nn.functional as F

    from mnb.megatron import fusions, loss_kernels

    results: dict = {}

    def relative(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    def cases():
        out = {}
        loss_kernels.runs_on(torch.device("cpu"))  # its probe, outside the counts
        # tokens, vocabulary: one partial block; a width of several blocks (the online max and sum carried
        # across them) with Megatron's padding columns at the dtype's lowest value; a strided row
        for tokens, width, shape in ((9, 300, "rows"), (5, 2 * loss_kernels.BLOCK + 37, "padded"),
                                     (6, 200, "strided")):
            for dtype in (torch.float32, torch.bfloat16):
                gen = torch.Generator().manual_seed(tokens + width)
                logits = (torch.randn(tokens, 2 * width if shape == "strided" else width, generator=gen) * 4)
                logits = logits.to(dtype)[:, :width] if shape == "strided" else logits.to(dtype)
                target = torch.randint(0, width - 40, (tokens,), generator=gen)
                if shape == "padded":
                    logits[:, -40:] = torch.finfo(dtype).min
                weights = torch.rand(tokens, generator=gen)
                exact_logits = logits.detach().float().requires_grad_()
                exact = fusions.vocab_parallel_cross_entropy(exact_logits, target, None, compiled=False)
                (exact * weights).sum().backward()
                reference = F.cross_entropy(logits.float(), target, reduction="none")
                got_logits = logits.detach().requires_grad_() if shape == "strided" else \
                    logits.detach().clone().requires_grad_()
                before = dict(loss_kernels.calls)
                got = loss_kernels.cross_entropy(got_logits, target, None)
                (got * weights).sum().backward()
                out[f"{shape}-{tokens}x{width}-{str(dtype)[6:]}"] = dict(
                    loss=relative(got, exact), torch=relative(got, reference),
                    grad=relative(got_logits.grad, exact_logits.grad),
                    padding_grad=float(got_logits.grad[:, -40:].float().abs().max()) if shape == "padded" else 0.0,
                    dtypes=[str(x.dtype)[6:] for x in (got, got_logits.grad)],
                    calls={k: loss_kernels.calls[k] - before[k] for k in before})
        # a user's mask: a whole block of -inf logits (the online max must not turn them into nan), and targets
        # outside the vocabulary (-100, as a padded label; counted 0, as Megatron's loss counts them)
        gen = torch.Generator().manual_seed(8)
        logits = torch.randn(4, loss_kernels.BLOCK + 50, generator=gen) * 4
        logits[:, :loss_kernels.BLOCK] = -float("inf")
        target = torch.tensor([loss_kernels.BLOCK + 3, -100, loss_kernels.BLOCK + 49, 10 ** 6])
        exact = fusions.vocab_parallel_cross_entropy(logits, target, None, compiled=False)
        got = loss_kernels.cross_entropy(logits, target, None)
        out["masked_and_outside"] = dict(loss=relative(got, exact), finite=bool(torch.isfinite(got).all()))
        logits, target = torch.randn(4, 64), torch.arange(4)
        out["applies"] = loss_kernels.applies(logits)
        out["refuses"] = {"not [tokens, vocabulary]": loss_kernels.applies(logits.view(2, 2, 64)),
                          "strided columns": loss_kernels.applies(logits[:, ::2]),
                          "integers": loss_kernels.applies(logits.long()),
                          "empty": loss_kernels.applies(torch.zeros(0, 64)),
                          **_refusals(loss_kernels, lambda: loss_kernels.applies(logits))}
        loss_kernels.runs_on(torch.device("cpu"))  # probed again (its cache was cleared), before the count
        before = (dict(loss_kernels.calls), dict(fusions.calls))
        fusions.vocab_parallel_cross_entropy(logits.view(2, 2, 64), target.view(2, 2))
        fusions.vocab_parallel_cross_entropy(logits, target, compiled=False)
        out["routed"] = [loss_kernels.calls["forward"] - before[0]["forward"],
                         fusions.calls["eager"] - before[1]["eager"]]
        return out

    if torch.distributed.get_rank() == 0:
        _guard(results, "kernels", cases)

    def split_over_tp2():
        """Each rank's half of one vocabulary over the world as the tp group: halves of two full blocks and a
        partial one, Megatron's padding at the end of the second, targets in both halves; fp32 and bf16."""
        out = {}
        part_width = 2 * loss_kernels.BLOCK + 37
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(5)
            whole = (torch.randn(12, 2 * part_width, generator=gen) * 4).to(dtype)
            whole[:, -40:] = torch.finfo(dtype).min
            target = torch.randint(0, 2 * part_width - 40, (12,), generator=gen)
            weights = torch.rand(12, generator=gen)
            exact_logits = whole.float().clone().requires_grad_()
            exact = F.cross_entropy(exact_logits, target, reduction="none")
            (exact * weights).sum().backward()
            rank = torch.distributed.get_rank()
            columns = slice(rank * part_width, (rank + 1) * part_width)
            part = whole[:, columns].clone().requires_grad_()
            got = loss_kernels.cross_entropy(part, target, torch.distributed.group.WORLD)
            (got * weights).sum().backward()
            out[str(dtype)[6:]] = dict(loss=relative(got, exact), grad=relative(part.grad, exact_logits.grad[:, columns]),
                                       targets_here=int(((target >= columns.start) & (target < columns.stop)).sum()))
        return out

    _guard(results, "tp2", split_over_tp2)
    return results


def own_kernels_model_interpreted() -> dict:
    """A fused model (the one a GPU rank builds: ``fusions.COMPILE_ON_CPU`` stands in for the GPU) where every
    mnb kernel runs (the interpreter): built under tp2 + sp, nothing is left to compile; trained 3 steps while
    another model's compile is pending, every norm, SwiGLU, RoPE and loss through mnb's kernels and none through
    a compiled or eager fused op, no step counted as compiling, with the losses and gradient norms of the same
    run unfused.  Then what ``model.fused_shapes`` leaves to compile (rank 0)."""
    import torch

    from mnb.config import ParallelConfig
    from mnb.megatron import background_compile, fusions, loss_kernels, norm_kernels, rope_kernels, swiglu_kernels
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt
    from mnb.megatron.train import train

    results: dict = {}
    modules = {"norm": norm_kernels, "swiglu": swiglu_kernels, "rope": rope_kernels, "loss": loss_kernels}

    def trained(fused: bool) -> dict:
        import types

        apply_layout(ParallelConfig(tp=2, sequence_parallel=True))
        torch.manual_seed(0)
        fusions.COMPILE_ON_CPU = fused
        # another model's compile still under way (never finishing here): this model needs none of it, so none
        # of its steps may count as compiling or wait for it
        background_compile._pending = types.SimpleNamespace(ready=False, keys=[("loss", 999, torch.bfloat16)])
        try:
            model = gpt("tiny", fusions=fused)
        finally:
            fusions.COMPILE_ON_CPU = False
        out = dict(compiles=bool(model.compile_keys), fused=model.fusions,
                   classes=sorted({type(m).__name__ for chunk in model.chunks for m in chunk.modules()
                                   if type(m).__name__.startswith("Fused")} | {type(model.chunks[0]).__name__}),
                   rope_fusion=model.transformer_config.apply_rope_fusion)
        if out["compiles"]:  # fail now rather than compile with Inductor's C++ backend for minutes
            raise AssertionError(f"a fused model where mnb's kernels run compiles: {model.compile_keys}")
        before = ({name: dict(m.calls) for name, m in modules.items()}, dict(fusions.calls))
        fusions.COMPILE_ON_CPU = fused  # fused ops that did not go to mnb's kernels would compile: counted below
        try:
            record = train(model, steps=3, **PARITY_BATCH)
        finally:
            fusions.COMPILE_ON_CPU = False
            background_compile._pending = None
        out.update(losses=_losses(record), grad_norms=[row["grad_norm"] for row in record["steps"]],
                   compiling=[row.get("compiling", False) for row in record["steps"]],
                   calls={name: m.calls["forward"] - before[0][name]["forward"] for name, m in modules.items()},
                   fused_op_calls={k: fusions.calls[k] - before[1][k] for k in fusions.calls})
        return out

    def left_to_compile():
        """What ``model.fused_shapes`` leaves for the background compile of tiny (tp up to 2): nothing where all of
        mnb's kernels run, each kernel's widths when its module is switched off, all without a device; no RoPE
        for a model without it."""
        import dataclasses

        from mnb.config import load_preset
        from mnb.megatron.model import fused_shapes

        tiny = load_preset("tiny")

        def kinds(config=tiny, **kw):
            return sorted(name for name, widths in fused_shapes(config, 2, swiglu=True, **kw).items() if widths)

        out = {"served": kinds(device=torch.device("cpu")), "no device": kinds(),
               "without RoPE": kinds(dataclasses.replace(tiny, position_embedding_type="learned_absolute"))}
        for name in ("swiglu", "rope", "loss"):
            modules[name].enabled = False
            try:
                out[f"{name} off"] = kinds(device=torch.device("cpu"))
            finally:
                modules[name].enabled = True
        return out

    _guard(results, "unfused", lambda: trained(False))
    _guard(results, "own-kernels", lambda: trained(True))
    if torch.distributed.get_rank() == 0:
        _guard(results, "left_to_compile", left_to_compile)
    return results


def triton_interpreted() -> dict:
    """The launch of test_decode_kernels.py, test_norm_kernels.py, test_swiglu_kernels.py, test_rope_kernels.py,
    test_loss_kernels.py and test_fp8_delayed.py: mnb's Triton kernels under Triton's interpreter (the launch sets
    TRITON_INTERPRET=1), on 2 CPU ranks, once for all."""
    return {"decode": decode_kernels_interpreted(), "norm": norm_kernels_interpreted(),
            "swiglu": swiglu_kernels_interpreted(), "rope": rope_kernels_interpreted(),
            "loss": loss_kernels_interpreted(), "own_model": own_kernels_model_interpreted(),
            "fp8_delayed": fp8_delayed_interpreted()}


def fp8_grid(dtype, tokens: int, width: int, gen, low: int):
    """Values of the FP8 format ``dtype`` (normal, exponents from ``low`` up, its largest value at [0, 0]), as
    fp32: scaled by a power of two they stay exact, so a cast of them rounds nothing (Triton's interpreter
    rounds FP8 unlike a GPU: ties away from zero, and a carry into the next power of two is lost)."""
    import torch

    bits, top = (3, 8) if dtype == torch.float8_e4m3fn else (2, 15)
    exponent = torch.randint(low, top + 1, (tokens, width), generator=gen)
    mantissa = torch.randint(0, 2 ** bits, (tokens, width), generator=gen)
    mantissa = torch.where(exponent == top, mantissa.clamp(max=2 ** bits - 2), mantissa)  # past the max: NaN/inf
    sign = torch.randint(0, 2, (tokens, width), generator=gen) * 2 - 1
    values = sign * (1 + mantissa / 2 ** bits) * torch.exp2(exponent.float())
    values[0, 0] = torch.finfo(dtype).max
    return values


def fp8_delayed_interpreted() -> dict:
    """mnb's delayed-scaling cast (mnb.megatron.fp8_delayed) under Triton's interpreter: the kernel against the
    same arithmetic as torch ops and against the definition, on sequences of tensors whose amaxes change
    call to call; FP8Linear inside a training step through the kernel against through torch's ops."""
    import torch

    from mnb.megatron import fp8, fp8_delayed

    results: dict = {}

    def casts():
        out = {"cases": 0, "scales": [], "wrong_scales": [], "data_mismatch": 0, "layout_mismatch": 0,
               "torch_mismatch": 0, "history_mismatch": 0, "absent_ok": True}
        fp8_delayed.runs_on(torch.device("cpu"))  # its probe, outside the counts
        before = dict(fp8_delayed.calls)
        gen = torch.Generator().manual_seed(0)
        powers = [0, 2, 1, 3, 0, 0, 1, 2, 3, 3, 0, 1]  # each tensor's amax: the format's max x 2**power
        for length in (1, 3, 16):
            for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                fmax = torch.finfo(dtype).max
                for rows, transposed in ((True, True), (True, False), (False, True)):
                    by_kernel, by_torch = fp8_delayed.AmaxHistory(length), fp8_delayed.AmaxHistory(length)
                    for call, power in enumerate(powers):
                        tokens = 21 + 48 * (call % 3)  # tiles cut short in both directions
                        low = -2 if dtype == torch.float8_e4m3fn else -10  # normal after a 2**-3 rescale
                        x = (fp8_grid(dtype, tokens, 72, gen, low) * 2.0 ** power).to(torch.bfloat16)
                        got = fp8_delayed.cast(x, dtype, by_kernel, rows=rows, transposed=transposed)
                        by_torch.prepare(x)
                        ref = fp8_delayed._cast_torch(x, dtype, by_torch, rows, transposed)
                        by_torch.calls += 1
                        seen = powers[max(0, call - length):call] or [powers[0]]  # the first call: its own
                        expected = fmax / (fmax * 2.0 ** max(seen))
                        out["cases"] += 1
                        out["scales"].append(float(got[2]))
                        if float(got[2]) != expected or float(ref[2]) != expected:
                            out["wrong_scales"].append((length, str(dtype), call, float(got[2]), expected))
                        exact = (x.float() * expected).clamp(-fmax, fmax).to(dtype).view(torch.uint8)
                        if rows:
                            out["data_mismatch"] += int((got[0].view(torch.uint8) != exact).sum())
                            out["torch_mismatch"] += int((ref[0].view(torch.uint8) != exact).sum())
                        if transposed:
                            out["layout_mismatch"] += int((got[1].view(torch.uint8) != exact.t()).sum())
                            out["layout_mismatch"] += int(not got[1].is_contiguous())
                        out["absent_ok"] &= (got[0] is None) != rows and (got[1] is None) != transposed
                        out["history_mismatch"] += int(by_kernel.amax() != by_torch.amax())
        out["calls"] = {k: fp8_delayed.calls[k] - before[k] for k in before}
        return out

    def linear():
        """FP8Linear in a step (weight_cache) with histories: the forward, input and weight gradients through the
        kernel equal those through torch's ops (grid-valued inputs and gradients: nothing rounds differently)."""
        gen = torch.Generator().manual_seed(1)
        rc = fp8.recipe("delayed")
        w = (fp8_grid(torch.float8_e4m3fn, 48, 64, gen, -2) / 2 ** 10).to(torch.bfloat16)
        inputs = [(fp8_grid(torch.float8_e4m3fn, 32, 64, gen, -2) * 2.0 ** p).to(torch.bfloat16) for p in (0, 1, 0)]
        grads = [(fp8_grid(torch.float8_e5m2, 32, 48, gen, -10) * 2.0 ** p).to(torch.bfloat16) for p in (1, 0, 2)]

        def run(kernel: bool):
            fp8_delayed.enabled = kernel
            histories = (fp8_delayed.AmaxHistory(), fp8_delayed.AmaxHistory())
            before = dict(fp8_delayed.calls)
            outs = []
            try:
                with fp8.weight_cache():
                    for x, g in zip(inputs, grads):
                        weight = w.clone().requires_grad_()
                        xx = x.clone().requires_grad_()
                        y = fp8.FP8Linear.apply(xx, weight, None, rc, False, False, None, histories)
                        y.backward(g)
                        outs.append((y.detach(), xx.grad, weight.grad))
            finally:
                fp8_delayed.enabled = True
            return outs, {k: fp8_delayed.calls[k] - before[k] for k in before}, histories[0].amax(), histories[1].amax()

        kernel, by_torch = run(True), run(False)
        diffs = [float((a.float() - b.float()).abs().max()) for ka, kb in zip(kernel[0], by_torch[0])
                 for a, b in zip(ka, kb)]
        return {"max_diff": max(diffs), "kernel_calls": kernel[1], "torch_calls": by_torch[1],
                "amaxes": [kernel[2], kernel[3], by_torch[2], by_torch[3]]}

    _guard(results, "casts", casts)
    _guard(results, "linear", linear)
    return results
