"""``mnb.hf_config(path)``: a Hugging Face checkpoint's ``config.json`` as a :class:`ModelConfig`.

Notebook side and rank side alike (json and the standard library only), so the
estimators, ``%mnb plan --model PATH``, the explorer and ``%mnb export`` can size a
Hugging Face model before any rank loads it, and :func:`mnb.from_hf` builds the same
model the notebook planned::

    cfg = mnb.hf_config("/models/Llama-3.2-1B")            # folder or its config.json
    cfg = mnb.hf_config("/models/Llama-3.2-1B", num_layers=4, seq_length=512)
    mnb.estimate.memory(cfg, mnb.ParallelConfig(tp=2))

Supported architectures (``config.json``'s ``architectures``): :data:`ARCHITECTURES`.
Anything Megatron-Core's GPT model cannot express (a RoPE scaling type other than Llama 3's,
sliding-window attention shorter than the sequence, an attention-only output bias, ...)
is refused here with the setting's name, so the notebook hears it before the ranks do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mnb.config import ModelConfig
from mnb.units import cwd_note

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "MixtralForCausalLM", "GPT2LMHeadModel")
"""The ``architectures`` values :func:`hf_config` and :func:`mnb.from_hf` accept."""

LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM")
"""Architectures with the Llama layout (RMSNorm, RoPE, SwiGLU; Mixtral's experts in place of the MLP)."""

_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel"}

DEFAULT_SEQ_LENGTH = 2048
"""``seq_length`` when not overridden: the checkpoint's ``max_position_embeddings``, at most this."""

# Llama 3's rope_scaling, as Megatron-Core's RotaryEmbedding applies it: only the factor is a
# parameter there (rope_utils: low_freq_factor=1, high_freq_factor=4, original context 8192).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def config_path(path: str | Path) -> Path:
    """The ``config.json`` of a checkpoint folder (or the file itself), or ValueError naming what is missing."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"{p} does not exist{cwd_note(p)}: a Hugging Face checkpoint folder holds config.json "
                         "(save one with transformers' save_pretrained or mnb.save_hf)")
    return p


def read_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` as a dict, with the file named in any error."""
    p = config_path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p} is not readable JSON ({exc}); fix or replace the file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p} holds {type(data).__name__}, not a JSON object of model settings")
    return data


def architecture(hf: dict[str, Any], where: str = "config.json") -> str:
    """The one supported architecture ``hf`` names, or ValueError listing the supported ones."""
    names = hf.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    if not names and hf.get("model_type") in _MODEL_TYPES:  # a config saved without a model class
        names = [_MODEL_TYPES[hf["model_type"]]]
    for name in names:
        if name in ARCHITECTURES:
            return name
    got = ", ".join(map(str, names)) or f"none (model_type {hf.get('model_type')!r})"
    raise ValueError(f"{where}: architecture {got} is not supported; mnb.from_hf reads "
                     f"{', '.join(ARCHITECTURES)}")


def _rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """rotary_base and Llama 3 scaling from either spelling (transformers 4's ``rope_theta`` +
    ``rope_scaling``, transformers 5's ``rope_parameters``)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type") or "default"
    scaling = {**scaling, **params}
    out: dict[str, Any] = {"rotary_base": theta if float(theta) != int(theta) else int(theta)}
    if kind == "default":
        return out
    if kind != "llama3":
        raise ValueError(f"{where}: RoPE scaling type {kind!r} cannot be expressed by Megatron-Core's "
                         "rotary embedding (mnb reads 'default' and 'llama3'); use a checkpoint without it")
    for name, value in _LLAMA3_FIXED.items():
        if name in scaling and float(scaling[name]) != value:
            raise ValueError(f"{where}: llama3 rope scaling with {name}={scaling[name]} cannot be expressed: "
                             f"Megatron-Core fixes {name} at {value:g}")
    out.update(rope_scaling=True, rope_scaling_factor=float(scaling.get("factor", 8.0)))
    return out


def _int(hf: dict[str, Any], key: str, arch: str, where: str) -> int:
    """A required positive integer setting, or ValueError naming it."""
    value = hf.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {arch} needs the setting {key!r} as a positive integer, got {value!r}")
    return value


def _llama_like(hf: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    heads = _int(hf, "num_attention_heads", arch, where)
    hidden = _int(hf, "hidden_size", arch, where)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported for {arch} (mnb builds SwiGLU: 'silu')")
    attention_bias = bool(hf.get("attention_bias", False))
    mlp_bias = bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ValueError(f"{where}: attention_bias={attention_bias} with mlp_bias={mlp_bias} cannot be "
                         "expressed (Megatron biases all linear layers or none, apart from q/k/v)")
    head_dim = hf.get("head_dim") or hidden // heads
    out: dict[str, Any] = dict(
        num_layers=_int(hf, "num_hidden_layers", arch, where), hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=_int(hf, "intermediate_size", arch, where),
        kv_channels=head_dim if head_dim * heads != hidden else None,
        normalization="RMSNorm", layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True, activation="silu", position_embedding_type="rope",
        add_bias_linear=attention_bias, add_qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        **_rope(hf, where),
    )
    if arch == "MixtralForCausalLM":
        out.update(num_moe_experts=_int(hf, "num_local_experts", arch, where),
                   moe_router_topk=hf.get("num_experts_per_tok", 2),
                   moe_ffn_hidden_size=hf["intermediate_size"])
        if float(hf.get("router_jitter_noise") or 0.0):
            raise ValueError(f"{where}: router_jitter_noise={hf['router_jitter_noise']} is not supported; set it to 0")
        if out["moe_router_topk"] == 1:
            raise ValueError(f"{where}: num_experts_per_tok=1: transformers' Mixtral weights each token's one expert by "
                             "1 (its top-k weights renormalised), and Megatron-Core routes to one expert only with a "
                             "softmax over all experts first (moe_router_pre_softmax), whose weights differ: mnb reads "
                             "Mixtral checkpoints with num_experts_per_tok >= 2")
    return out


def _gpt2(hf: dict[str, Any], where: str) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    acts = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if act not in acts:
        raise ValueError(f"{where}: activation_function {act!r} is not supported for GPT2LMHeadModel "
                         f"(mnb reads {', '.join(acts)})")
    for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(name):
            raise ValueError(f"{where}: {name}=true is not supported; Megatron's attention has no such option")
    if hf.get("scale_attn_weights", True) is False:
        raise ValueError(f"{where}: scale_attn_weights=false is not supported (Megatron scales by 1/sqrt(head_dim))")
    arch = "GPT2LMHeadModel"
    hidden = _int(hf, "n_embd", arch, where)
    return dict(
        num_layers=_int(hf, "n_layer", arch, where), hidden_size=hidden,
        num_attention_heads=_int(hf, "n_head", arch, where),
        ffn_hidden_size=hf.get("n_inner") or 4 * hidden, max_position_embeddings=_int(hf, "n_positions", arch, where),
        normalization="LayerNorm", layernorm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        gated_linear_unit=False, activation=acts[act], position_embedding_type="learned_absolute",
        add_bias_linear=True, add_qkv_bias=True,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", True)),
    )


def hf_config(path: str | Path, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of the Hugging Face checkpoint at ``path`` (a folder or its config.json).

    ``overrides`` use :func:`mnb.gpt`'s names (``num_layers=4`` for a shallower copy,
    ``seq_length=512``); ``seq_length`` defaults to ``max_position_embeddings``, at most
    :data:`DEFAULT_SEQ_LENGTH`.  ValueError, naming the file and the setting, for anything
    mnb cannot build.
    """
    where = str(config_path(path))
    hf = read_config(path)
    arch = architecture(hf, where)
    try:
        fields = _gpt2(hf, where) if arch == "GPT2LMHeadModel" else _llama_like(hf, arch, where)
    except KeyError as exc:
        raise ValueError(f"{where}: {arch} needs the setting {exc.args[0]!r}, which is missing") from None
    fields.setdefault("max_position_embeddings", hf.get("max_position_embeddings", DEFAULT_SEQ_LENGTH))
    fields["vocab_size"] = hf.get("vocab_size")
    if not isinstance(fields["vocab_size"], int):
        raise ValueError(f"{where}: vocab_size {fields['vocab_size']!r} is not an integer")
    fields["seq_length"] = min(fields["max_position_embeddings"], DEFAULT_SEQ_LENGTH)
    window = hf.get("sliding_window")
    if isinstance(window, int) and hf.get("use_sliding_window", arch != "Qwen2ForCausalLM"):
        fields["sliding_window"] = window  # ModelConfig refuses sequences past it
        fields["seq_length"] = min(fields["seq_length"], window)
    if isinstance(hf.get("initializer_range"), float):
        fields["init_method_std"] = hf["initializer_range"]
    fields = {k: v for k, v in fields.items() if v is not None}
    name = Path(where).parent.name or arch
    try:
        cfg = ModelConfig(name=name, **fields).with_overrides(**overrides) if overrides else ModelConfig(name=name, **fields)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return cfg


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` for a :class:`ModelConfig` of a supported shape (for :func:`mnb.save_hf` of an ``mnb.gpt`` model).

    Llama-like models become ``LlamaForCausalLM`` (``Qwen2ForCausalLM`` with q/k/v biases,
    ``MixtralForCausalLM`` with experts); LayerNorm + GELU + learned positions become
    ``GPT2LMHeadModel``.  ValueError for shapes no supported architecture has.
    """
    llama = (cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and cfg.activation == "silu"
             and cfg.position_embedding_type == "rope")
    gpt2 = (cfg.normalization == "LayerNorm" and not cfg.gated_linear_unit and cfg.activation in ("gelu", "gelu_tanh")
            and cfg.position_embedding_type == "learned_absolute" and cfg.add_bias_linear
            and not cfg.is_moe and cfg.kv_channels in (None, cfg.hidden_size // cfg.num_attention_heads)
            and cfg.query_groups == cfg.num_attention_heads)
    if gpt2:
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": cfg.num_layers,
            "n_embd": cfg.hidden_size, "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn,
            "n_positions": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
            "layer_norm_epsilon": cfg.layernorm_epsilon, "tie_word_embeddings": cfg.share_embeddings_and_output_weights,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        }
    # biases on every linear: Llama's attention_bias + mlp_bias (q/k/v included); Qwen2 and Mixtral have none
    llama_biases = cfg.add_bias_linear and cfg.add_qkv_bias and not cfg.is_moe
    if not llama or (cfg.add_bias_linear and not llama_biases):
        raise ValueError(f"model {cfg.name!r} ({cfg.normalization}, activation {cfg.activation}, gated "
                         f"{cfg.gated_linear_unit}, {cfg.position_embedding_type} positions, add_bias_linear "
                         f"{cfg.add_bias_linear}, add_qkv_bias {cfg.add_qkv_bias}, "
                         f"{'MoE' if cfg.is_moe else 'dense'}) matches none of {', '.join(ARCHITECTURES)}; "
                         "mnb.save_hf writes only those")
    arch, kind = ("LlamaForCausalLM", "llama")
    if cfg.is_moe:
        arch, kind = ("MixtralForCausalLM", "mixtral")
    elif cfg.add_qkv_bias and not cfg.add_bias_linear:
        arch, kind = ("Qwen2ForCausalLM", "qwen2")
    if cfg.is_moe and cfg.add_qkv_bias:
        raise ValueError(f"model {cfg.name!r}: experts with q/k/v biases match no supported architecture")
    out: dict[str, Any] = {
        "architectures": [arch], "model_type": kind, "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.moe_ffn if cfg.is_moe else cfg.ffn, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.layernorm_epsilon,
        "hidden_act": "silu", "tie_word_embeddings": cfg.share_embeddings_and_output_weights,
        "rope_theta": cfg.rotary_base, "attention_dropout": 0.0,
    }
    if llama_biases:
        out.update(attention_bias=True, mlp_bias=True)
    if cfg.sliding_window is not None:
        out.update(sliding_window=cfg.sliding_window)
    if cfg.rope_scaling:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, **_LLAMA3_FIXED}
    if cfg.is_moe:
        out.update(num_local_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk)
    return out


class _CallableModule(type(json)):
    """This module, callable as :func:`hf_config`.

    ``mnb.hf_config`` is the public function, but importing the submodule ``mnb.hf_config``
    (as the rank side and the magics do) binds the module under the same name on the
    package, hiding the lazily exported function; a callable module keeps
    ``mnb.hf_config(path)`` working whichever was bound last.
    """

    def __call__(self, path: str | Path, **overrides: Any) -> ModelConfig:
        return hf_config(path, **overrides)


import sys as _sys  # noqa: E402  (only for the class swap below)

_sys.modules[__name__].__class__ = _CallableModule
