"""Name mapping of the Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``).

=====================================================  ====================================================
Megatron (local spec)                                  Hugging Face
=====================================================  ====================================================
``embedding.word_embeddings.weight``                   ``model.embed_tokens.weight`` (vocab rows over tp)
``decoder.layers.L.input_layernorm.weight``            ``model.layers.L.input_layernorm.weight``
``decoder.layers.L.self_attention.linear_qkv.weight``  ``...self_attn.{q,k,v}_proj.weight`` (per query group)
``decoder.layers.L.self_attention.linear_qkv.bias``    ``...self_attn.{q,k,v}_proj.bias`` (Qwen2)
``decoder.layers.L.self_attention.linear_proj.weight`` ``...self_attn.o_proj.weight`` (input dim over tp)
``decoder.layers.L.pre_mlp_layernorm.weight``          ``model.layers.L.post_attention_layernorm.weight``
``decoder.layers.L.mlp.linear_fc1.weight``             ``...mlp.{gate,up}_proj.weight`` (``[gate_r; up_r]``)
``decoder.layers.L.mlp.linear_fc2.weight``             ``...mlp.down_proj.weight``
``decoder.final_layernorm.weight``                     ``model.norm.weight``
``output_layer.weight``                                ``lm_head.weight`` (``model.embed_tokens.weight`` if tied)
=====================================================  ====================================================

Megatron's non-interleaved RoPE rotates halves, as transformers' Llama does: q and k need no
permutation.  Mixtral's experts replace the MLP rows (:mod:`.mixtral`).
"""

from __future__ import annotations

from mnb.config import ModelConfig
from mnb.megatron.hf.rules import Rule


def attention(cfg: ModelConfig, L: int, hf_prefix: str) -> dict[str, Rule]:
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.query_groups * cfg.head_dim
    a = f"{hf_prefix}.self_attn"
    m = f"decoder.layers.{L}.self_attention"
    out = {
        f"{m}.linear_qkv.weight": Rule("qkv", (f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"),
                                       ((q, h), (kv, h), (kv, h))),
        f"{m}.linear_proj.weight": Rule("row", (f"{a}.o_proj.weight",), ((h, q),)),
    }
    if cfg.add_qkv_bias or cfg.add_bias_linear:
        out[f"{m}.linear_qkv.bias"] = Rule("qkv", (f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias"),
                                           ((q,), (kv,), (kv,)))
    if cfg.add_bias_linear:
        out[f"{m}.linear_proj.bias"] = Rule("full", (f"{a}.o_proj.bias",), ((h,),))
    return out


def mlp(cfg: ModelConfig, L: int, hf_prefix: str) -> dict[str, Rule]:
    h, f = cfg.hidden_size, cfg.ffn
    p, m = f"{hf_prefix}.mlp", f"decoder.layers.{L}.mlp"
    out = {
        f"{m}.linear_fc1.weight": Rule("gated", (f"{p}.gate_proj.weight", f"{p}.up_proj.weight"), ((f, h), (f, h))),
        f"{m}.linear_fc2.weight": Rule("row", (f"{p}.down_proj.weight",), ((h, f),)),
    }
    if cfg.add_bias_linear:
        out[f"{m}.linear_fc1.bias"] = Rule("gated", (f"{p}.gate_proj.bias", f"{p}.up_proj.bias"), ((f,), (f,)))
        out[f"{m}.linear_fc2.bias"] = Rule("full", (f"{p}.down_proj.bias",), ((h,),))
    return out


def tensors(cfg: ModelConfig, mlp_rules=mlp) -> dict[str, Rule]:
    """Every Megatron parameter of the whole model -> its :class:`Rule` (``mlp_rules``: Mixtral's experts)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    embed = Rule("vocab", ("model.embed_tokens.weight",), ((v, h),))
    out = {"embedding.word_embeddings.weight": embed}
    for L in range(cfg.num_layers):
        hf = f"model.layers.{L}"
        out[f"decoder.layers.{L}.input_layernorm.weight"] = Rule("full", (f"{hf}.input_layernorm.weight",), ((h,),))
        out.update(attention(cfg, L, hf))
        out[f"decoder.layers.{L}.pre_mlp_layernorm.weight"] = Rule(
            "full", (f"{hf}.post_attention_layernorm.weight",), ((h,),))
        out.update(mlp_rules(cfg, L, hf))
    out["decoder.final_layernorm.weight"] = Rule("full", ("model.norm.weight",), ((h,),))
    out["output_layer.weight"] = embed if cfg.share_embeddings_and_output_weights else \
        Rule("vocab", ("lm_head.weight",), ((v, h),))
    return out
