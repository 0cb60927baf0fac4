"""Activation memory of one transformer layer for one microbatch, itemised.

The items are those of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", arXiv 2205.05198, sec. 4 and
Table 2), kept per tensor so that they follow the model instead of GPT-3's
shape.  For a GPT-3-style layer (MHA, GeLU MLP with ffn = 4h, dropout,
unfused attention, 2-byte activations) the sum is exactly the paper's

    no parallelism           s*b*h*(34 + 5*a*s/h)
    tp, no sp                s*b*h*(10 + 24/t + 5*a*s/(h*t))
    tp + sp                  s*b*h*(34 + 5*a*s/h) / t
    tp + sp + selective      s*b*h*34 / t
    full recompute           2*s*b*h (/t with sp)   (only the layer input is kept)

and with selective recompute it matches Megatron-LM's own estimator
(theoretical_memory_usage.py: s*b*h*(18 + 4*ffn/h)/t) when ffn = 4h.  Beyond
that estimator it counts GQA (K, V are kv-sized), SwiGLU (fc1 output is
2*ffn wide, the fused SwiGLU keeps only its input), RoPE (rotated Q and K are
new tensors), flash/SDPA attention (no s*s matrices, a fp32 log-sum-exp
instead), dropout masks only when ``model.extra`` sets dropout > 0 (mnb's
default is 0), and MoE layers (top-k routed copies of
each token; the routing probabilities scale the experts' activation output, so
the combine keeps nothing).  Checked per component against the tensors CPU
ranks save for backward (tests/megatron/test_memory.py).  Context parallelism divides the sequence: s -> s/cp,
and mnb's all-gather cp attention (mnb.megatron.context_parallel) keeps the whole
sequence's K/V in each layer (:func:`cp_attention_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mnb.config import ModelConfig

from ._inputs import dropout


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """Everything the per-layer activation formula depends on."""

    seq: int
    """Sequence length on this rank (already divided by cp)."""
    micro_batch: int
    tp: int
    sequence_parallel: bool
    element_bytes: int
    """2 for bf16/fp16 activations, 4 for fp32."""
    recompute: str
    """'none', 'selective' (Megatron's default recompute_modules=['core_attn']) or 'full'."""
    fused_attention: bool
    """True for flash/SDPA/TE fused attention (no s*s score matrices stored)."""
    fused_kernels: bool = True
    """mnb's compiled SwiGLU and RoPE (``mnb.gpt(fusions=...)`` on CUDA ranks).  Without them
    Megatron's SwiGLU keeps silu(x1), x2 and their product beside fc1's output (5 ffn-wide
    tensors instead of 3) and its RoPE keeps the cos/sin tables of q and k."""
    cpu_kernels: bool = False
    """CPU ranks: torch's CPU norms are decomposed and keep the normalised input and the
    inverse RMS beside their input (measured with ``saved_tensors_hooks``)."""
    cp: int = 1
    """Context-parallel size (``seq`` is already divided by it)."""


def layer_activation_bytes(model: ModelConfig, shape: LayerShape) -> float:
    """Bytes one layer keeps for backward, for one microbatch, on one rank.

    With ``recompute='full'`` this is only the checkpointed layer input; the
    rematerialised layer of the backward pass is :func:`full_layer_bytes`.
    """
    s, b, h, t, e = shape.seq, shape.micro_batch, model.hidden_size, shape.tp, shape.element_bytes
    sp_div = t if shape.sequence_parallel else 1
    if shape.recompute == "full":
        return s * b * h * e / sp_div
    return full_layer_bytes(model, shape)


def full_layer_bytes(model: ModelConfig, shape: LayerShape) -> float:
    """Bytes of all saved tensors of one layer (no full recompute), one microbatch."""
    s, b, h, t, e = shape.seq, shape.micro_batch, model.hidden_size, shape.tp, shape.element_bytes
    a = model.num_attention_heads
    q = a * model.head_dim
    kv = model.query_groups * model.head_dim
    sp_div = t if shape.sequence_parallel else 1
    sbh_rep = s * b * h * e / sp_div  # replicated over tp unless sequence parallel
    mask = s * b * h / sp_div  # 1-byte dropout mask
    hidden_drop = dropout(model, "hidden_dropout") > 0
    attn_drop = dropout(model, "attention_dropout") > 0
    selective = shape.recompute == "selective"

    # Attention block: norm input, QKV input, Q/K/V, core attention, proj input, dropout.
    attn = 2 * sbh_rep + norm_extra_bytes(shape, h)
    attn += s * b * (q + 2 * kv) * e / t
    if model.position_embedding_type == "rope":
        attn += s * b * (q + kv) * e / t
        if not shape.fused_kernels:
            attn += 4 * s * model.head_dim * e  # cos and sin tables, for q and for k
    if not selective:
        if shape.fused_attention:
            attn += (a / t) * s * b * 4  # fp32 log-sum-exp per row
        else:
            scores = (a / t) * s * s * b
            attn += scores * e  # softmax output
            if attn_drop:
                attn += scores * (1 + e)  # dropout mask + dropout output
    attn += s * b * q * e / t
    if shape.cp > 1 and not selective:
        attn += cp_attention_bytes(model, shape)
    if hidden_drop:
        attn += mask

    # MLP block.
    gate = 2 if model.gated_linear_unit else 1
    mlp = 2 * sbh_rep + norm_extra_bytes(shape, h)  # norm input, fc1/router input
    if model.is_moe:
        k, ffn, n_exp = model.moe_router_topk, model.moe_ffn, model.num_moe_experts
        mlp += 2 * s * b * n_exp * 4 / sp_div  # fp32 router logits and probabilities
        mlp += s * b * k * h * e  # permuted tokens: expert fc1 inputs (gathered over expert tp)
        mlp += s * b * k * ffn * gate * e / t  # expert fc1 outputs
        if model.gated_linear_unit:  # experts run Megatron's own SwiGLU (mnb fuses the dense MLP only)
            mlp += 2 * s * b * k * ffn * e / t
        # The routing probabilities scale the activation output inside the expert MLP
        # (megatron-core 0.16-0.19): the activation output, the scaled fc2 input, the probabilities.
        mlp += 2 * s * b * k * ffn * e / t + s * b * k * 4
    else:
        mlp += s * b * model.ffn * gate * e / t
        mlp += s * b * model.ffn * e / t
        if model.gated_linear_unit and not shape.fused_kernels:
            mlp += 2 * s * b * model.ffn * e / t  # unfused SwiGLU: silu(x1) and x2 kept apart
    if hidden_drop:
        mlp += mask
    return attn + mlp


def norm_extra_bytes(shape: LayerShape, hidden: int) -> float:
    """What one norm keeps beyond its input on CPU ranks (normalised input + inverse RMS); 0 elsewhere."""
    if not shape.cpu_kernels:
        return 0.0
    sp_div = shape.tp if shape.sequence_parallel else 1
    return shape.seq * shape.micro_batch * (hidden * shape.element_bytes + 4) / sp_div


def cp_attention_bytes(model: ModelConfig, shape: LayerShape) -> float:
    """What mnb's all-gather cp attention keeps beyond cp=1's core attention, one layer, one microbatch.

    SDPA saves the gathered keys and values of the whole sequence (``2 * kv *
    seq * cp``) and the outputs of its two query chunks, which are copied into the
    output projection's input (at cp=1 that input is a view of SDPA's output).
    With RoPE the rotated query is still saved but the QKV projection output
    and the rotated keys no longer are; without RoPE the query is a view of that
    output, which stays.  CPU ranks materialise each lower-right causal mask
    (fp32, chunk x keys seen; the largest rank holds ``(2cp+1) * chunk**2``).
    Measured with ``saved_tensors_hooks`` on CPU ranks (tests/megatron/test_memory.py).
    With selective recompute the checkpoint keeps only the local Q/K/V: nothing extra.
    """
    s, b, t, e, cp = shape.seq, shape.micro_batch, shape.tp, shape.element_bytes, shape.cp
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    extra = 2 * s * cp * b * kv * e / t + s * b * q * e / t
    if model.position_embedding_type == "rope":
        extra -= s * b * (q + 2 * kv) * e / t + s * b * kv * e / t
    if shape.cpu_kernels:
        chunk = s // 2
        extra += 4 * chunk * chunk * (2 * cp + 1)
    return extra
