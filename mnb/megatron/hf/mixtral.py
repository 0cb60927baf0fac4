"""Name mapping of ``MixtralForCausalLM``: the Llama mapping with experts in place of the MLP.

==============================================================  ===============================================
Megatron (local spec, SequentialMLP)                            Hugging Face
==============================================================  ===============================================
``decoder.layers.L.mlp.router.weight``                          ``model.layers.L.block_sparse_moe.gate.weight``
``decoder.layers.L.mlp.experts.local_experts.E.linear_fc1.weight``  ``...block_sparse_moe.experts.E.{w1,w3}.weight``
``decoder.layers.L.mlp.experts.local_experts.E.linear_fc2.weight``  ``...block_sparse_moe.experts.E.w2.weight``
==============================================================  ===============================================

``E`` is the global expert: ep rank ``e`` holds experts ``e * n/ep ... (e+1) * n/ep - 1``; their
weights are split over the expert tensor-parallel group like a dense SwiGLU MLP.  Routing is
Megatron's default (top-k of the router logits, then softmax), which equals Mixtral's softmax
-> top-2 -> renormalise.
"""

from __future__ import annotations

from mnb.config import ModelConfig
from mnb.megatron.hf import llama
from mnb.megatron.hf.rules import Rule


def experts(cfg: ModelConfig, L: int, hf_prefix: str) -> dict[str, Rule]:
    h, f = cfg.hidden_size, cfg.moe_ffn
    p, m = f"{hf_prefix}.block_sparse_moe", f"decoder.layers.{L}.mlp"
    out = {f"{m}.router.weight": Rule("full", (f"{p}.gate.weight",), ((cfg.num_moe_experts, h),))}
    for e in range(cfg.num_moe_experts):
        x, me = f"{p}.experts.{e}", f"{m}.experts.local_experts.{e}"
        out[f"{me}.linear_fc1.weight"] = Rule("gated", (f"{x}.w1.weight", f"{x}.w3.weight"), ((f, h), (f, h)),
                                              expert=True)
        out[f"{me}.linear_fc2.weight"] = Rule("row", (f"{x}.w2.weight",), ((h, f),), expert=True)
    return out


def tensors(cfg: ModelConfig) -> dict[str, Rule]:
    return llama.tensors(cfg, mlp_rules=experts)
