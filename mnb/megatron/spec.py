"""Transformer layer specs for mnb's GPT recipes.

- Transformer Engine importable: Megatron's own TE spec
  (``get_gpt_layer_with_transformer_engine_spec``).  Untested in this project
  (TE is not installed on its test machines); kept on Megatron's public API.
- Otherwise a fast local spec: Megatron's local spec with two swaps

  * core attention -> :class:`SDPAttention`, ``torch.nn.functional.
    scaled_dot_product_attention`` (causal, GQA).  Megatron's unfused
    ``DotProductAttention`` materialises the s x s scores (measured on 1xH200,
    GPT 1.35B, seq 2048: 31% MFU / 60.8 GiB vs 66% / 24.2 GiB with SDPA).
  * norms -> :class:`LocalNorm` (LayerNorm or RMSNorm) whose weights carry
    ``sequence_parallel=True`` when sp is on, so Megatron's grad finalisation
    all-reduces them across tp.  (``WrappedTorchNorm`` refuses sequence
    parallelism; apex/TE norms are not needed.)

  With context parallelism (cp > 1) :class:`SDPAttention` all-gathers keys and
  values over the cp group and attends its two sequence chunks against them
  (:mod:`mnb.megatron.context_parallel`); with TE, Megatron's TE attention does cp.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from mnb.config import ModelConfig
from mnb.megatron import norm_kernels


@functools.lru_cache(maxsize=1)
def have_te() -> bool:
    """True when Transformer Engine's PyTorch bindings import."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a TE build that does not match torch/CUDA
        return False
    return True


def fp8_supported() -> bool:
    """FP8 needs Transformer Engine and a Hopper-or-newer GPU (compute capability >= 9)."""
    return have_te() and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


class SDPAttention(torch.nn.Module):
    """Megatron core attention through ``F.scaled_dot_product_attention``.

    Takes Megatron's shapes: query ``[sq, b, np, hn]``, key/value
    ``[sk, b, ng, hn]`` (np, ng: heads and query groups on this tp rank);
    returns ``[sq, b, np * hn]``.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        **_: object,
    ) -> None:
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        self.cp_group = None
        if config.context_parallel_size > 1:
            from mnb.megatron import context_parallel

            context_parallel.check_comm_type(cp_comm_type)
            if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
                raise ValueError(
                    f"context parallelism (cp={config.context_parallel_size}) on the local spec "
                    f"supports causal or unmasked attention, not {attn_mask_type.name}; use cp=1"
                )
            self.cp_group = context_parallel.cp_group(pg_collection)
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences need Transformer Engine attention")
        from megatron.core.transformer.enums import AttnMaskType

        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, heads, dim = query.shape
        dropout_p = self.dropout_p if self.training else 0.0
        if self.cp_group is not None:
            if attention_bias is not None or (attention_mask is not None and mask_type != AttnMaskType.causal):
                raise NotImplementedError(
                    "an attention mask or bias with cp > 1 needs Transformer Engine attention; "
                    "the local spec's cp attends causally or to every key")
            from mnb.megatron.context_parallel import attention

            out = attention(query, key, value, group=self.cp_group, causal=mask_type == AttnMaskType.causal,
                            scale=self.softmax_scale, dropout_p=dropout_p)
            return out.reshape(sq, b, heads * dim)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        causal = mask_type == AttnMaskType.causal
        mask = None
        if attention_bias is not None:
            mask = attention_bias
        elif attention_mask is not None:
            # Megatron: True = masked out; SDPA: True = attend.  With a causal mask type a mask is
            # given only for packed examples (mnb.megatron.instructions.attention_mask: causal
            # within each example), so it replaces the plain causal mask.
            mask = ~attention_mask
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=causal and mask is None,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != heads,
        )
        # [b, n, s, d] -> [s, b, n * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)


class LocalNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (``config.normalization``) that supports sequence parallel.

    Built by Megatron as ``LocalNorm(config=, hidden_size=, eps=)``; parameter
    names match ``torch.nn.LayerNorm``/``RMSNorm`` so checkpoints interchange
    with Megatron's ``WrappedTorchNorm``.
    """

    own_kernels = False
    """RMSNorm through :mod:`mnb.megatron.norm_kernels` where they apply (:class:`FusedLocalNorm`)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__()
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("layernorm_zero_centered_gamma is not supported by the local spec")
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.hidden_size = hidden_size
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # under torch.compile Inductor fuses the norm itself (and a probe must not be traced)
        if (self.own_kernels and self.rms and not torch.compiler.is_compiling()
                and norm_kernels.applies(x, self.weight)):
            return norm_kernels.rms_norm(x, self.weight, self.eps)
        return self.torch_forward(x)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm through torch's own ops."""
        if self.rms:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


class FusedLocalNorm(LocalNorm):
    """:class:`LocalNorm` of a model built with fused kernels: its RMSNorm is one Triton kernel each way
    on GPU ranks (:mod:`mnb.megatron.norm_kernels`), torch's norm elsewhere.  The same parameters."""

    own_kernels = True


@functools.lru_cache(maxsize=1)
def _fused_mlp_class():
    from megatron.core.transformer.mlp import MLP

    from mnb.megatron.fusions import compiled_by_default, swiglu

    class FusedSwiGLUMLP(MLP):
        """Megatron's MLP with its SwiGLU as one compiled kernel each way (mnb.megatron.fusions).

        Built only where ``swiglu_applies`` (a plain bias-free SwiGLU); per-token
        scales go through Megatron's own forward.  Other keyword arguments (0.19
        passes ``padding_mask``) are unused by Megatron's dense MLP too.
        ``own_kernels`` False (a decode step without mnb's kernels sets it on the
        instance) keeps the SwiGLU compiled by Inductor where it would be mnb's Triton one.
        """

        own_kernels = True

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            if per_token_scale is not None:
                return super().forward(hidden_states, per_token_scale, **kwargs)
            intermediate, _ = self.linear_fc1(hidden_states)
            compiled = None if self.own_kernels else compiled_by_default(intermediate)
            return self.linear_fc2(swiglu(intermediate, compiled=compiled))

    return FusedSwiGLUMLP


def uses_fused_swiglu(chunks) -> bool:
    """Whether any of these model chunks was built with :class:`FusedSwiGLUMLP`."""
    cls = _fused_mlp_class()
    return any(isinstance(m, cls) for chunk in chunks for m in chunk.modules())


def _with_mlp_class(mlp, cls):
    """The dense-MLP entry of a layer spec, building ``cls`` instead of Megatron's ``MLP``.

    megatron-core 0.16 writes it as ``ModuleSpec(module=MLP, ...)``; 0.19 as
    ``functools.partial(MLP.as_mlp_submodule, submodules=...)``.  Anything else
    is returned unchanged.
    """
    from megatron.core.transformer.mlp import MLP

    if isinstance(mlp, functools.partial):
        func = mlp.func
        if getattr(func, "__self__", None) is MLP and func.__name__ == "as_mlp_submodule":
            return functools.partial(cls.as_mlp_submodule, *mlp.args, **mlp.keywords)
        return mlp
    if getattr(mlp, "module", None) is MLP:
        return dataclasses.replace(mlp, module=cls)
    return mlp


def layer_spec(model: ModelConfig, transformer_config, *, use_te: bool | None = None,
               fused: bool = False):
    """The ModuleSpec of one transformer layer (TE when available, else local).

    ``fused``: the local spec's dense SwiGLU MLP runs mnb's compiled SwiGLU, and its norms are
    :class:`FusedLocalNorm`.
    """
    use_te = have_te() if use_te is None else use_te
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_moe_experts,
            moe_grouped_gemm=bool(model.num_moe_experts),
            qk_layernorm=bool(model.extra.get("qk_layernorm", False)),
        )
    spec = specs.get_gpt_layer_local_spec(
        num_experts=model.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=bool(model.extra.get("qk_layernorm", False)),
        normalization=model.normalization,
    )
    sub = spec.submodules
    mlp = sub.mlp
    if fused and not model.num_moe_experts:
        from mnb.megatron.fusions import swiglu_applies

        if swiglu_applies(transformer_config):
            mlp = _with_mlp_class(mlp, _fused_mlp_class())
    norm = FusedLocalNorm if fused else LocalNorm
    attention = dataclasses.replace(
        sub.self_attention,
        submodules=dataclasses.replace(sub.self_attention.submodules, core_attention=SDPAttention),
    )
    return dataclasses.replace(
        spec,
        submodules=dataclasses.replace(
            sub, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=attention,
            mlp=mlp,
        ),
    )


def block_spec(model: ModelConfig, transformer_config, *, vp_stage: int | None = None,
               fused: bool = False):
    """Spec of this rank's transformer block (its layers and the final norm)."""
    if have_te():
        return layer_spec(model, transformer_config, use_te=True)
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = layer_spec(model, transformer_config, use_te=False, fused=fused)
    num_layers = get_num_layers_to_build(transformer_config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers,
                                      layer_norm=FusedLocalNorm if fused else LocalNorm)
