"""Name mapping of ``GPT2LMHeadModel``.

============================================================  =====================================================
Megatron (local spec)                                         Hugging Face (Conv1D weights stored ``[in, out]``)
============================================================  =====================================================
``embedding.word_embeddings.weight``                          ``transformer.wte.weight``
``embedding.position_embeddings.weight``                      ``transformer.wpe.weight`` (learned positions)
``decoder.layers.L.input_layernorm.{weight,bias}``            ``transformer.h.L.ln_1.{weight,bias}``
``decoder.layers.L.self_attention.linear_qkv.{weight,bias}``  ``transformer.h.L.attn.c_attn.*`` (``q | k | v``, per head)
``decoder.layers.L.self_attention.linear_proj.{weight,bias}`` ``transformer.h.L.attn.c_proj.*``
``decoder.layers.L.pre_mlp_layernorm.{weight,bias}``          ``transformer.h.L.ln_2.{weight,bias}``
``decoder.layers.L.mlp.linear_fc1.{weight,bias}``             ``transformer.h.L.mlp.c_fc.*``
``decoder.layers.L.mlp.linear_fc2.{weight,bias}``             ``transformer.h.L.mlp.c_proj.*``
``decoder.final_layernorm.{weight,bias}``                     ``transformer.ln_f.{weight,bias}``
``output_layer.weight``                                       ``transformer.wte.weight`` (tied; else ``lm_head.weight``)
============================================================  =====================================================

The MLP's GELU is the tanh approximation (``gelu_new``: ModelConfig ``activation="gelu_tanh"``).
"""

from __future__ import annotations

from mnb.config import ModelConfig
from mnb.megatron.hf.rules import Rule


def _norm(m: str, hf: str, h: int) -> dict[str, Rule]:
    return {f"{m}.weight": Rule("full", (f"{hf}.weight",), ((h,),)),
            f"{m}.bias": Rule("full", (f"{hf}.bias",), ((h,),))}


def tensors(cfg: ModelConfig) -> dict[str, Rule]:
    h, v, f = cfg.hidden_size, cfg.vocab_size, cfg.ffn
    embed = Rule("vocab", ("transformer.wte.weight",), ((v, h),))
    out = {"embedding.word_embeddings.weight": embed,
           "embedding.position_embeddings.weight": Rule("full", ("transformer.wpe.weight",),
                                                        ((cfg.max_position_embeddings, h),))}
    for L in range(cfg.num_layers):
        hf, m = f"transformer.h.{L}", f"decoder.layers.{L}"
        out.update(_norm(f"{m}.input_layernorm", f"{hf}.ln_1", h))
        out.update(_norm(f"{m}.pre_mlp_layernorm", f"{hf}.ln_2", h))
        a, ma = f"{hf}.attn", f"{m}.self_attention"
        out[f"{ma}.linear_qkv.weight"] = Rule("qkv", (f"{a}.c_attn.weight",), ((h, 3 * h),), transposed=True)
        out[f"{ma}.linear_qkv.bias"] = Rule("qkv", (f"{a}.c_attn.bias",), ((3 * h,),), transposed=True)
        out[f"{ma}.linear_proj.weight"] = Rule("row", (f"{a}.c_proj.weight",), ((h, h),), transposed=True)
        out[f"{ma}.linear_proj.bias"] = Rule("full", (f"{a}.c_proj.bias",), ((h,),))
        p, mm = f"{hf}.mlp", f"{m}.mlp"
        out[f"{mm}.linear_fc1.weight"] = Rule("column", (f"{p}.c_fc.weight",), ((h, f),), transposed=True)
        out[f"{mm}.linear_fc1.bias"] = Rule("column", (f"{p}.c_fc.bias",), ((f,),))
        out[f"{mm}.linear_fc2.weight"] = Rule("row", (f"{p}.c_proj.weight",), ((f, h),), transposed=True)
        out[f"{mm}.linear_fc2.bias"] = Rule("full", (f"{p}.c_proj.bias",), ((h,),))
    out.update(_norm("decoder.final_layernorm", "transformer.ln_f", h))
    out["output_layer.weight"] = embed if cfg.share_embeddings_and_output_weights else \
        Rule("vocab", ("lm_head.weight",), ((v, h),))
    return out
