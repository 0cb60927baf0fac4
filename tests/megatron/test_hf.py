"""Hugging Face checkpoints on real CPU ranks: from_hf -> logits under every layout -> train -> save_hf -> back.

Tiny random checkpoints are built here with transformers (no downloads): Llama (GQA, untied),
Qwen2 (q/k/v biases, tied), Mixtral (4 experts, top-2) and GPT-2 (LayerNorm with biases,
gelu_new, Conv1D, learned positions, tied).  transformers' own logits, computed once in this
process, are the reference for ``mnb.logits`` under each layout; one cell per layout checks
every architecture (a layout change is in-process).  One 2-rank pool for the module, one
4-rank pool for tp2*pp2.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import mnb
from mnb.config import ParallelConfig
from mnb.errors import CompositeRankError

pytestmark = pytest.mark.slow

LAYERS = 4  # pp2 * vpp2 needs 4
TOKENS = 13  # odd: sequence and context parallelism pad it
ATOL = 1e-4


def _build(folder, kind: str, *, dtype=None, shard: str | None = None):
    import torch
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                              MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    torch.manual_seed({"llama": 1, "qwen2": 2, "mixtral": 3, "gpt2": 4}[kind])
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                 num_hidden_layers=LAYERS, vocab_size=300, max_position_embeddings=64, initializer_range=0.1)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**small, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**small, tie_word_embeddings=True))
    elif kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2))
    else:
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=4, n_layer=LAYERS, vocab_size=300, n_positions=64,
                                           initializer_range=0.1, bos_token_id=0, eos_token_id=0))
    if kind != "gpt2":  # random biases/norms, so a wrong mapping of them shows in the logits
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
    else:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model


def reference_logits(folder, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, reference logits); the token ids shared by every cell."""
    root = tmp_path_factory.mktemp("hf")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=(2, TOKENS)).tolist()
    out = {}
    for kind in ("llama", "qwen2", "mixtral", "gpt2"):
        folder = root / kind
        _build(folder, kind)
        out[kind] = (str(folder), reference_logits(folder, tokens))
    sharded = root / "llama-bf16-sharded"
    import torch

    _build(sharded, "llama", dtype=torch.bfloat16, shard="40KB")
    out["llama-bf16-sharded"] = (str(sharded), reference_logits(sharded, tokens))
    return {"models": out, "tokens": tokens, "root": root}


def _logits_cell(models: dict, tokens, kwargs: dict | None = None) -> str:
    paths = {name: folder for name, (folder, _) in models.items()}
    return (f"_out = {{}}\n"
            f"for _name, _path in {paths!r}.items():\n"
            f"    _m = mnb.from_hf(_path, **{kwargs or {}!r}.get(_name, {{}}))\n"
            f"    _out[_name] = mnb.logits(_m, {tokens!r}).numpy()\n"
            f"del _m\n"
            f"_out")


def _check(results: dict, models: dict, label: str) -> None:
    for rank, per_model in results.items():
        assert set(per_model) == set(models), (label, rank)
        for name, got in per_model.items():
            want = models[name][1]
            assert got.shape == want.shape, (label, rank, name, got.shape)
            err = float(np.abs(got - want).max())
            assert err < ATOL, f"{label} rank {rank} {name}: max |mnb - transformers| = {err:.2e}"


LAYOUTS_2 = {
    "1 rank (dp2)": (ParallelConfig(), ("llama", "qwen2", "mixtral", "gpt2", "llama-bf16-sharded")),
    "tp2": (ParallelConfig(tp=2), ("llama", "qwen2", "gpt2")),
    "tp2+sp": (ParallelConfig(tp=2, sequence_parallel=True), ("llama", "qwen2", "mixtral", "gpt2")),
    "pp2": (ParallelConfig(pp=2), ("llama", "qwen2", "mixtral", "gpt2")),
    "pp2-vpp2": (ParallelConfig(pp=2, vpp=2), ("llama", "qwen2", "mixtral", "gpt2")),
    "cp2": (ParallelConfig(cp=2), ("llama", "qwen2", "mixtral", "gpt2")),
    "ep2": (ParallelConfig(ep=2), ("mixtral",)),
}


@pytest.mark.parametrize("label", list(LAYOUTS_2))
def test_logits_equal_transformers_under_each_layout(cpu_pool, checkpoints, label):
    layout, names = LAYOUTS_2[label]
    models = {n: checkpoints["models"][n] for n in names}
    results = cpu_pool.run(_logits_cell(models, checkpoints["tokens"]), layout=layout, quiet=True)
    _check(results, models, label)
