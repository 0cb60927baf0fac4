"""Parameter counts per rank and pipeline stage.

Megatron-Core's layout: column-parallel weights (QKV, fc1) and row-parallel
weights (proj, fc2) are split across tp; norms and row-parallel biases are
replicated; the word embedding and the output layer are vocabulary-parallel
(split across tp, padded vocabulary).  Pipeline stage 0 holds the embedding,
the last stage the final norm and the output layer (and, with tied embeddings
and pp > 1, its own copy of the embedding matrix).  MoE expert weights are
split across ep (experts) and across the expert tensor-parallel size, which
Megatron-Core defaults to tp.
"""

from __future__ import annotations

from dataclasses import dataclass

from mnb.config import LoraConfig, ModelConfig, ParallelConfig

from ._inputs import padded_vocab_size


@dataclass(frozen=True, kw_only=True)
class StageParams:
    """Parameters held by one rank of pipeline stage ``stage``."""

    stage: int
    num_layers: int
    """Transformer layers on this rank (all its virtual chunks together)."""
    dense: int
    """Non-expert parameters (attention, norms, dense MLPs, routers, embeddings)."""
    expert: int
    """MoE expert parameters (sharded by ep and expert tp)."""
    embedding: int
    """Of ``dense``: word/position embedding, output layer and final norm on this stage."""

    @property
    def total(self) -> int:
        return self.dense + self.expert


def _norm_size(model: ModelConfig) -> int:
    return 1 if model.normalization == "RMSNorm" else 2


def layer_params(model: ModelConfig, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of one transformer layer on one rank."""
    h = model.hidden_size
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    bias = model.add_bias_linear
    gate = 2 if model.gated_linear_unit else 1
    attention = (h * (q + 2 * kv) + q * h) // tp
    if bias:
        attention += (q + 2 * kv) // tp + h
    elif model.add_qkv_bias:  # Qwen2: biases on q/k/v only
        attention += (q + 2 * kv) // tp
    norms = 2 * h * _norm_size(model)
    if model.is_moe:
        experts_local = model.num_moe_experts // ep
        one_expert = (h * model.moe_ffn * gate + model.moe_ffn * h) // tp
        if bias:
            one_expert += model.moe_ffn * gate // tp + h
        router = h * model.num_moe_experts
        return attention + norms + router, experts_local * one_expert
    mlp = (h * model.ffn * gate + model.ffn * h) // tp
    if bias:
        mlp += model.ffn * gate // tp + h
    return attention + norms + mlp, 0


def stage_params(model: ModelConfig, parallel: ParallelConfig, stage: int) -> StageParams:
    """Parameters on one rank of pipeline stage ``stage`` (0-based)."""
    pp, tp = parallel.pp, parallel.tp
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, pp({pp})), got {stage}")
    layers = model.layers_per_stage(pp)[stage]
    dense_layer, expert_layer = layer_params(model, tp, parallel.ep)
    h = model.hidden_size
    vocab = padded_vocab_size(model, tp)
    embedding = 0
    if stage == 0:
        embedding += vocab * h // tp
        if model.position_embedding_type == "learned_absolute":
            embedding += model.max_position_embeddings * h
    if stage == pp - 1:
        embedding += h * _norm_size(model)
        if not model.share_embeddings_and_output_weights or pp > 1:
            embedding += vocab * h // tp
    return StageParams(
        stage=stage,
        num_layers=layers,
        dense=layers * dense_layer + embedding,
        expert=layers * expert_layer,
        embedding=embedding,
    )


def lora_projections(model: ModelConfig) -> dict[str, tuple[int, int, str, str]]:
    """Hugging Face projection name -> (in, out, ``column``/``row``, Megatron linear) of one layer."""
    h, q, kv = model.hidden_size, model.num_attention_heads * model.head_dim, model.query_groups * model.head_dim
    f = model.moe_ffn if model.is_moe else model.ffn
    if not model.gated_linear_unit:  # GPT-2's Conv1D names
        return {"c_attn": (h, q + 2 * kv, "column", "linear_qkv"), "c_proj": (q, h, "row", "linear_proj"),
                "c_proj ": (f, h, "row", "linear_fc2"), "c_fc": (h, f, "column", "linear_fc1")}
    return {"q_proj": (h, q, "column", "linear_qkv"), "k_proj": (h, kv, "column", "linear_qkv"),
            "v_proj": (h, kv, "column", "linear_qkv"), "o_proj": (q, h, "row", "linear_proj"),
            "gate_proj": (h, f, "column", "linear_fc1"), "up_proj": (h, f, "column", "linear_fc1"),
            "down_proj": (f, h, "row", "linear_fc2")}


def lora_layer_params(model: ModelConfig, lora: LoraConfig, tp: int = 1) -> int:
    """LoRA adapter parameters of one transformer layer on one rank (Hu et al. 2021: ``r * (in + out)``
    per projection; column-parallel: ``B`` split over tp, row-parallel: ``A``).  MoE experts take none."""
    wanted = set(lora.resolved_targets(gpt2=not model.gated_linear_unit))
    total = 0
    for name, (n_in, n_out, kind, megatron) in lora_projections(model).items():
        if name.strip() not in wanted and megatron not in wanted:
            continue
        if model.is_moe and megatron in ("linear_fc1", "linear_fc2"):
            raise ValueError(f"LoRA on MoE experts ({name.strip()}) is not supported; target the attention "
                             "projections (q_proj, k_proj, v_proj, o_proj)")
        total += lora.rank * (n_in + n_out // tp) if kind == "column" else lora.rank * (n_in // tp + n_out)
    return total
