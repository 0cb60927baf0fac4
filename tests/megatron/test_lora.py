"""LoRA on real CPU ranks (fp32) against peft 0.21 on transformers: mnb.lora, load/save_adapter, merge, save_hf.

Tiny random checkpoints (Llama: GQA, SwiGLU; GPT-2: fused Conv1D c_attn; Mixtral: experts) and
peft adapters with non-zero weights (``init_lora_weights=False``) are built in this process;
peft's logits are the reference for ``mnb.logits`` after ``mnb.load_adapter`` under each layout.
Then LoRA trains under tp2: peft loads ``mnb.save_adapter``'s folder and transformers
``mnb.save_hf``'s merged one with mnb's logits; pp2 reads both back (and ``mnb.save``/``mnb.load``
moves the adapters to the new layout).  One shared 2-rank pool.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mnb.config import ParallelConfig
from mnb.errors import CompositeRankError
from tests.megatron.hf_reference import reference_logits as hf_logits

pytestmark = pytest.mark.slow

ATOL = 1e-4
LAYERS = 4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _build(folder, kind: str):
    import torch
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                              MixtralForCausalLM)

    torch.manual_seed({"llama": 11, "mixtral": 13, "gpt2": 14}[kind])
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                 num_hidden_layers=LAYERS, vocab_size=300, max_position_embeddings=64, initializer_range=0.1)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**small))
    elif kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2))
    else:
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=4, n_layer=LAYERS, vocab_size=300, n_positions=64,
                                           initializer_range=0.1, bos_token_id=0, eos_token_id=0))
    model.eval().save_pretrained(folder)
    return model


PROMPT, NEW = 6, 4  # mnb.generate continues tokens[0][:PROMPT] by NEW tokens, greedy


def peft_logits(base_folder, adapter_folder, tokens, greedy: bool = False):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, adapter_folder).eval()
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens)).logits.numpy()
        if not greedy:
            return logits
        ids = list(tokens[0][:PROMPT])
        for _ in range(NEW):
            ids.append(int(model(torch.as_tensor([ids])).logits[0, -1].argmax()))
        return logits, ids[PROMPT:]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Checkpoints, peft adapters (r=4, alpha=8, random A and B) and peft's logits with them."""
    import torch
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("lora")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=(2, 13)).tolist()
    targets = {"llama": ALL, "gpt2": ["c_attn", "c_proj", "c_fc"], "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    models = {}
    for kind, names in targets.items():
        base = _build(root / kind, kind)
        torch.manual_seed(7)
        peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=names, init_lora_weights=False))
        peft.save_pretrained(root / f"{kind}-adapter")
        logits, continued = peft_logits(root / kind, root / f"{kind}-adapter", tokens, greedy=True)
        models[kind] = (str(root / kind), str(root / f"{kind}-adapter"), logits, hf_logits(root / kind, tokens),
                        continued)
    return {"models": models, "tokens": tokens, "root": root}


def _adapter_cell(models: dict, tokens, generate: bool) -> str:
    paths = {name: (m[0], m[1]) for name, m in models.items()}
    return ("_out = {}\n"
            f"for _name, (_base, _adapter) in {paths!r}.items():\n"
            "    _m = mnb.from_hf(_base)\n"
            "    _s = mnb.load_adapter(_m, _adapter)\n"
            f"    _out[_name] = (mnb.logits(_m, {tokens!r}).numpy(), _s.trainable, _s.total,\n"
            f"                   mnb.generate(_m, [{tokens[0][:PROMPT]!r}], max_new_tokens={NEW}, stream=False)[0]\n"
            f"                   if {generate} else None)\n"
            "del _m\n"
            "_out")


LAYOUTS = {
    "1 rank (dp2)": (ParallelConfig(), ("llama", "gpt2")),
    "tp2": (ParallelConfig(tp=2), ("llama", "gpt2")),
    "tp2+sp": (ParallelConfig(tp=2, sequence_parallel=True), ("llama", "gpt2")),
    "pp2": (ParallelConfig(pp=2), ("llama", "gpt2")),
    "pp2-vpp2": (ParallelConfig(pp=2, vpp=2), ("llama",)),
    "cp2": (ParallelConfig(cp=2), ("llama",)),
    "ep2": (ParallelConfig(ep=2), ("mixtral",)),
}


def test_peft_adapters_give_peft_logits_under_each_layout(cpu_pool, made):
    """A peft adapter with random A and B on every projection (GPT-2's fused c_attn; Llama's q/k/v inside
    Megatron's head-interleaved QKV, gate/up inside fc1): mnb.logits within 1e-4 of peft's and mnb.generate
    continuing as peft's greedy decoding, every layout (generate switches sequence parallelism off)."""
    counts = {}
    for label, (layout, names) in LAYOUTS.items():
        models = {n: made["models"][n] for n in names}
        generate = layout.cp == 1  # mnb.generate does not run under cp
        results = cpu_pool.run(_adapter_cell(models, made["tokens"], generate), layout=layout, quiet=True)
        for rank, per_model in results.items():
            for name, (got, trainable, total, continued) in per_model.items():
                want, base = models[name][2], models[name][3]
                assert float(np.abs(want - base).max()) > 0.1  # the adapter matters
                err = float(np.abs(got - want).max())
                assert err < ATOL, f"{label} rank {rank} {name}: max |mnb - peft| = {err:.2e}"
                if generate:  # mnb.generate continues as peft's greedy decoding
                    assert continued == models[name][4], (label, rank, name, continued)
                counts.setdefault(name, set()).add((trainable, total))
    # the same counts under every layout: peft's (r * (in + out) per adapter; the checkpoint's tensors)
    per_layer = 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 96))  # q, k and v, o, gate/up/down
    assert counts["llama"] == {(LAYERS * per_layer, 161_856 + LAYERS * per_layer)}, counts["llama"]
    assert len(counts["gpt2"]) == 1 and len(counts["mixtral"]) == 1, counts


def test_lora_trains_alike_under_pp2_tp2_and_sequence_parallel(cpu_pool, made):
    """User trial 12-05: a one-piece adapter's B (down_proj's, q_proj's) has its A's key, and was set up as its
    A is: under tp2 a whole B counted twice in the gradient norm (sqrt 2 times: clipping clipped other steps),
    and under tp2 + sp a whole B missed the sum of its two sequence halves while a split one added them, so
    the losses left pp2's from the second step.  Now each step's loss and gradient norm are the same."""
    base = made["models"]["llama"][0]
    cell = (f"_m = mnb.from_hf({base!r})\n"
            "mnb.lora(_m, rank=4, alpha=8, targets=('q_proj', 'down_proj'))\n"
            "_r = mnb.train(_m, steps=3, micro_batch_size=2, global_batch_size=4, lr=5e-2, data='mock')\n"
            "[(s['loss'], s['grad_norm']) for s in _r['steps']]")
    layouts = {"pp2": ParallelConfig(pp=2), "tp2": ParallelConfig(tp=2),
               "tp2 + sp": ParallelConfig(tp=2, sequence_parallel=True)}
    steps = {label: cpu_pool.run(cell, layout=layout, quiet=True)[0] for label, layout in layouts.items()}
    for label, run in steps.items():
        for (loss, norm), (ref_loss, ref_norm) in zip(run, steps["pp2"]):
            assert loss == pytest.approx(ref_loss, rel=1e-4) and norm == pytest.approx(ref_norm, rel=1e-4), (
                label, run, steps["pp2"])
    assert steps["pp2"][2][0] < steps["pp2"][0][0] - 0.05, steps["pp2"]  # it trained


def test_lora_trains_under_tp2_then_peft_transformers_and_pp2_agree(cpu_pool, made):
    """Train LoRA 3 steps under tp2 (only the adapters get gradients and Adam's state); save_adapter -> peft
    and save_hf -> transformers give mnb's logits; merging changes only the targeted projections; pp2
    reads the adapter folder back, and mnb.save/mnb.load moves the adapters from tp2 to pp2."""
    base, _, _, base_logits, _ = made["models"]["llama"]
    tokens, root = made["tokens"], made["root"]
    adapter, merged, ckpt = str(root / "trained-adapter"), str(root / "trained-merged"), str(root / "trained-ckpt")
    trained = cpu_pool.run(
        f"_m = mnb.from_hf({base!r})\n"
        "_before = {n: p.detach().clone() for c in _m.chunks for n, p in c.named_parameters()}\n"
        "_s = mnb.lora(_m, rank=4, alpha=8, targets=('q_proj', 'v_proj', 'gate_proj', 'down_proj'))\n"
        "_r = mnb.train(_m, steps=3, micro_batch_size=2, global_batch_size=2, lr=2e-2, data='mock')\n"
        "_opt = [p for o in getattr(_m.optimizer, 'chained_optimizers', [_m.optimizer])\n"
        "        for g in o.optimizer.param_groups for p in g['params']]\n"
        "_adapters = [p for c in _m.chunks for n, p in c.named_parameters() if '.lora.' in n]\n"
        "_grads = [n for c in _m.chunks for n, p in c.named_parameters() if getattr(p, 'main_grad', None) is not None]\n"
        f"_logits = mnb.logits(_m, {tokens!r}).numpy()\n"
        f"mnb.save_adapter({adapter!r}, _m)\n"
        f"mnb.save_hf({merged!r}, _m)\n"
        f"mnb.save({ckpt!r}, _m)\n"
        "_n = mnb.merge_lora(_m)\n"
        "_changed = sorted(n for c in _m.chunks for n, p in c.named_parameters() if not (p == _before[n]).all())\n"
        f"_after = mnb.logits(_m, {tokens!r}).numpy()\n"
        "(_logits, _after, _changed, _n, len(_opt), sum(p.numel() for p in _opt),\n"
        " sum(p.numel() for p in _adapters), _grads, repr(_s), _r['memory_components'])",
        layout=ParallelConfig(tp=2), quiet=True)
    mine = trained[0][0]
    for rank, (logits, after, changed, n, n_opt, opt_numel, adapter_numel, grads, summary, measured) in \
            trained.items():
        # counted: fp32 gradients and Adam's two moments of the adapters alone (the base's weights are 20x more)
        assert adapter_numel * 4 <= measured["gradients"] <= adapter_numel * 4 + 4096, (measured, adapter_numel)
        assert adapter_numel * 8 <= measured["optimizer"] <= adapter_numel * 12 + 4096, (measured, adapter_numel)
        assert np.array_equal(logits, mine), rank
        assert float(np.abs(mine - base_logits).max()) > 1e-2, "training changed nothing"
        assert float(np.abs(after - mine).max()) < ATOL, (rank, "merge_lora changed the logits")
        assert n == 3 * LAYERS and n_opt == 4 * 2 * LAYERS and opt_numel == adapter_numel, (n, n_opt, opt_numel)
        assert grads and all(".lora." in g for g in grads), grads  # DDP gave gradients to the adapters only
        assert changed == sorted(f"decoder.layers.{L}.{p}.weight" for L in range(LAYERS)
                                 for p in ("self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")), changed
        assert "on down_proj, gate_proj, q_proj, v_proj" in summary, summary
    config = json.loads((root / "trained-adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["target_modules"] == [
        "down_proj", "gate_proj", "q_proj", "v_proj"]
    err = float(np.abs(peft_logits(base, adapter, tokens) - mine).max())
    assert err < ATOL, f"peft on mnb.save_adapter's folder differs by {err:.2e}"
    err = float(np.abs(hf_logits(merged, tokens) - mine).max())
    assert err < ATOL, f"transformers on mnb.save_hf's merged folder differs by {err:.2e}"
    back = cpu_pool.run(
        f"_a = mnb.from_hf({base!r})\n"
        f"mnb.load_adapter(_a, {adapter!r})\n"
        f"_b = mnb.from_hf({base!r})\n"
        "mnb.lora(_b, rank=4, alpha=8, targets=('q_proj', 'v_proj', 'gate_proj', 'down_proj'))\n"
        f"_info = mnb.load({ckpt!r}, _b)\n"
        "mnb.train(_b, steps=1, micro_batch_size=2, global_batch_size=2, data='mock')  # continues under pp2\n"
        f"(mnb.logits(_a, {tokens!r}).numpy(), _info['step'])",
        layout=ParallelConfig(pp=2), quiet=True)
    for rank, (logits, step) in back.items():
        assert float(np.abs(logits - mine).max()) < ATOL, rank
        assert step == 3, step


FLOP_CELL = """
import torch
from torch.utils.flop_counter import FlopCounterMode

def _sdpa(q, k, v, *args, out_shape=None, **kwargs):  # QK^T and AV in full, as the model FLOPs count them
    return 4 * q[0] * q[1] * q[2] * k[2] * q[3]

def _sdpa_backward(grad, q, k, v, *args, out_shape=None, **kwargs):  # four GEMMs of the same size
    return 8 * q[0] * q[1] * q[2] * k[2] * q[3]

_aten = torch.ops.aten
_formulas = {_aten._scaled_dot_product_flash_attention_for_cpu: _sdpa,
             _aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward}
from mnb.megatron.peak import cpu_gemm_flops
cpu_gemm_flops(torch.float32)  # the rank's GEMM peak for MFU, measured once per process: not the step's
_flops = {}
for _label, _targets in _cases.items():
    _m = mnb.from_hf(_base, seq_length=32)
    if _targets:
        mnb.lora(_m, rank=4, alpha=8, targets=_targets)
    with FlopCounterMode(display=False, custom_mapping=_formulas) as _counter:
        _r = mnb.train(_m, steps=1, micro_batch_size=2, global_batch_size=4, data="mock")
    _flops[_label] = (_counter.get_total_flops(), _r["model_flops_per_step"], _r["memory_components"]["activations"])
del _m
_flops
"""


def test_lora_step_runs_its_model_flops_and_holds_no_more_than_full_fine_tuning(cpu_pool, made):
    """A training step's model FLOPs (the run record's, which MFU divides) equal the FLOPs of the GEMMs and
    attention kernels the ranks ran (torch's FlopCounterMode, summed over dp2): full fine-tuning, and LoRA
    whose frozen weights get no weight gradient and whose first layer has no backward before its first
    adapter (q_proj first; o_proj first: layer 0's attention has no backward; gate_proj first).  And the
    activations LoRA holds (counted tensors) are no more than full fine-tuning's: an adapter inside a fused
    linear (q, k, v; gate, up) adds its output in place of its rows without keeping it for the backward."""
    cases = {"full": None, "all-linear": "all-linear", "q,v (peft's default)": ("q_proj", "v_proj"),
             "o_proj": ("o_proj",), "gate_proj": ("gate_proj",)}
    base = made["models"]["llama"][0]
    results = cpu_pool.run(f"_cases = {cases!r}\n_base = {base!r}\n" + FLOP_CELL, quiet=True)
    for label in cases:
        ran = sum(per_rank[label][0] for per_rank in results.values())  # each dp rank ran half the batch
        counted = {per_rank[label][1] for per_rank in results.values()}
        assert len(counted) == 1, counted
        assert ran == pytest.approx(counted.pop(), rel=1e-9), (label, ran)
    for rank, per_rank in results.items():
        full_flops, full_acts = per_rank["full"][1], per_rank["full"][2]
        assert per_rank["all-linear"][1] < 0.8 * full_flops  # no weight gradient for the frozen weights
        for label in cases:
            assert per_rank[label][2] <= 1.02 * full_acts, (rank, label, per_rank[label][2], full_acts)


def test_bad_adapter_folders_and_targets_are_refused_alike(cpu_pool, made):
    base, good = made["models"]["llama"][0], made["models"]["llama"][1]
    root = made["root"] / "bad"
    root.mkdir()
    from safetensors.torch import load_file, save_file

    def copy(name: str):
        folder = root / name
        shutil.copytree(good, folder)
        return folder

    unknown = copy("unknown-module")
    config = json.loads((unknown / "adapter_config.json").read_text())
    full_paths = copy("full-paths")  # peft's "all-linear" on a model of fewer than 20 linears: every module's path
    names = sorted({k.split("base_model.model.", 1)[1].rsplit(".lora_", 1)[0]
                    for k in load_file(str(full_paths / "adapter_model.safetensors"))})
    assert "model.layers.0.mlp.down_proj" in names
    (full_paths / "adapter_config.json").write_text(json.dumps({**config, "target_modules": names}))
    experts = copy("expert-parameters")  # what peft's "all-linear" writes for Mixtral: experts' weights too
    (experts / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": ["gate_up_proj"],
                                                             "rank_pattern": {".*\\.gate_up_proj": 4}}))
    (unknown / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "w9"]}))
    rank = copy("rank-mismatch")
    (rank / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    missing = copy("no-weights")
    (missing / "adapter_model.safetensors").unlink()
    layer9 = copy("layer-9")  # a module this 4-layer model has not

    weights = load_file(str(layer9 / "adapter_model.safetensors"))
    save_file({k.replace("layers.0.", "layers.9."): v for k, v in weights.items()}, str(layer9 / "adapter_model.safetensors"))
    gpt2_adapter = made["models"]["gpt2"][1]  # c_attn etc.: not this model's projections
    cases = [
        (str(unknown), ["unknown-module/adapter_config.json: unknown target module 'w9'"]),
        (str(rank), ["rank-mismatch/adapter_model.safetensors: rank mismatch:", "says r=8"]),
        (str(missing), ["no-weights/adapter_model.safetensors is missing"]),
        (str(experts), ["expert-parameters/adapter_config.json: target_parameters is ['gate_up_proj']",
                        "MoE experts' weights"]),
        (str(layer9), ["layer-9/adapter_model.safetensors: unknown target module model.layers.9.mlp.down_proj"]),
        (gpt2_adapter, ["gpt2-adapter/adapter_config.json: unknown target module 'c_", "for this model (llama)"]),
    ]
    for folder, fragments in cases:
        with pytest.raises(CompositeRankError, match="2 of 2 ranks raised") as info:
            cpu_pool.run(f"mnb.load_adapter(mnb.from_hf({base!r}), {folder!r})", layout=ParallelConfig(tp=2),
                         quiet=True)
        text = str(info.value)
        assert "[r0-1] ValueError" in text, text  # one error, the same on both ranks
        assert all(f in text for f in fragments), text
    with pytest.raises(CompositeRankError, match="2 of 2 ranks raised") as info:
        cpu_pool.run(f"mnb.lora(mnb.from_hf({base!r}), targets=('c_attn',))", layout=ParallelConfig(tp=2), quiet=True)
    assert "has no projection 'c_attn'; its projections are" in str(info.value), str(info.value)
    # the pool is still usable, and the folder naming each module by its path loads after all that, as peft's
    got = cpu_pool.run(f"_m = mnb.from_hf({base!r})\nmnb.load_adapter(_m, {str(full_paths)!r})\n"
                       f"mnb.logits(_m, {made['tokens']!r}).numpy()", layout=ParallelConfig(tp=2), quiet=True)
    for logits in got.values():
        assert float(np.abs(logits - made["models"]["llama"][2]).max()) < ATOL


def test_lora_under_zero3_trains_as_under_ddp(cpu_pool, made):
    """Megatron-FSDP (ZeRO-3) with adapters: the same steps as Megatron DDP where Megatron-FSDP leaves frozen
    weights alone (megatron-core 0.19); refused with what to do where it hooks them too (0.16)."""
    import megatron.core

    base, tokens = made["models"]["llama"][0], made["tokens"]
    cell = (f"_m = mnb.from_hf({base!r})\n"
            "mnb.lora(_m, rank=4, alpha=8, targets=('q_proj', 'v_proj'))\n"
            "mnb.train(_m, steps=3, micro_batch_size=2, global_batch_size=4, lr=2e-2, data='mock')\n"
            f"mnb.logits(_m, {tokens!r}).numpy()")
    ddp = cpu_pool.run(cell, layout=ParallelConfig(), quiet=True)
    if megatron.core.__version__.startswith("0.16"):
        with pytest.raises(CompositeRankError, match="cannot train LoRA adapters here: drop --fsdp"):
            cpu_pool.run(cell, layout=ParallelConfig(fsdp="optim_grads_params"), quiet=True)
        return
    zero3 = cpu_pool.run(cell, layout=ParallelConfig(fsdp="optim_grads_params"), quiet=True)
    for rank in (0, 1):
        assert float(np.abs(zero3[rank] - ddp[rank]).max()) < ATOL, rank
        assert float(np.abs(ddp[rank] - made["models"]["llama"][3]).max()) > 1e-3  # it trained
