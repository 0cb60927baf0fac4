"""The per-rank run record that ``mnb.train`` returns and publishes.

Schema (JSON-able; the controller, ``mnb.analysis.runs`` and ``mnb.plot`` read it)::

    {
      "rank": int, "world_size": int,
      "coords": {"tp", "pp", "dp", "cp", "ep"},          # this rank's index in each group
      "layout": ParallelConfig.as_dict() (dp filled),
      "model": ModelConfig.to_dict(), "train": TrainConfig.to_dict(),
      "lora": LoraConfig fields | None,                 # mnb.lora's adapters (base weights frozen)
      "tokenizer": str | None,                          # folder of a Hugging Face model's tokenizer
      "data_prefix": str | None,                        # the .bin/.idx prefix text data was read from
      "device": "cpu" | "cuda:N", "device_name": str,
      "num_microbatches": int,                          # per step, per dp rank
      "global_batch_size": int, "seq_length": int,
      "num_parameters_local": int, "padded_vocab_size": int,
      "model_flops_per_step": float,                    # whole model, global batch, no recompute
      "peak_flops": float, "peak_source": str,          # CPU ranks: measured GEMM peak (mnb.megatron.peak)
      "fusions": bool,                                  # mnb.gpt(fusions=...) resolved on this rank
      "steps": [{"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s",
                 "mem_allocated_bytes", "mem_peak_bytes", "mem_reserved_bytes"}],
      "timeline": [{"step", "stage", "chunk", "kind", "microbatch", "start_s", "end_s"}],
      "memory": {"peak_allocated_bytes", "peak_reserved_bytes", "capacity_bytes"},
      "memory_source": "cuda" | "rss",
      "memory_components": {"weights", "gradients", "optimizer", "activations",   # bytes, counted
                            "activations_per_microbatch", "peak", "peak_source"},  # (memory.ComponentMeter)
      "megatron_core_version": str,
    }

``loss`` is the global batch's average per-token loss, the same on every rank.
``timeline`` times are seconds from the start of their step; ``kind`` is
"forward", "backward", a Megatron p2p name ("forward-recv", "backward-send",
"forward-send-backward-recv", ...), "all-grads-sync" (and other
finalize_model_grads timers), or "optimizer".
"""

from __future__ import annotations

import dataclasses

import platform

import torch

from mnb.config import ModelConfig


def device_of() -> torch.device:
    """This rank's compute device: CPU in CPU mode, else the current CUDA device."""
    from mnb.megatron import cpu

    if cpu.installed() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def model_flops_per_step(cfg: ModelConfig, global_batch_size: int, padded_vocab_size: int, lora=None) -> float:
    """Model FLOPs of one training step (forward + backward, no recompute), whole model.

    Megatron-LM's ``num_floating_point_operations`` (training.py), after
    Narayanan et al. 2021 (arXiv 2104.04473, appendix "Floating-point
    operations"): 12 = 3 (forward, wgrad, dgrad) * 2 (two GEMMs per block) *
    2 (multiply-add), per layer ``12 B s h^2 [(1 + g/a + s/h) q/h + f k (ffn/h)]``
    with g/a query groups per head, q = heads * head_dim, k experts per token,
    f = 3/2 for gated MLPs; plus the logits ``6 B s h V``.  Core attention is
    counted in full (not halved for causal masking), as in megatron-core 0.16.

    With LoRA (``lora``, a :class:`mnb.config.LoraConfig`), only what the backward does (Megatron's
    ``linear_with_frozen_weight`` computes no weight gradient; autograd skips what nothing trainable
    needs): :func:`lora_flops_saved` less, and the adapters' ``6 B s r (in + out)`` more.
    """
    b, s, h, layers = global_batch_size, cfg.seq_length, cfg.hidden_size, cfg.num_layers
    q = cfg.num_attention_heads * cfg.head_dim
    gated = 1.5 if cfg.gated_linear_unit else 1.0
    if cfg.is_moe:
        mlp = (cfg.moe_ffn / h) * cfg.moe_router_topk * gated
    else:
        mlp = (cfg.ffn / h) * gated
    attention = (1 + cfg.query_groups / cfg.num_attention_heads + s / h) * (q / h)
    full = float(12 * b * s * layers * h * h * (attention + mlp) + 6 * b * s * h * padded_vocab_size)
    if lora is None:
        return full
    from mnb.estimate.params import lora_layer_params

    return full - lora_flops_saved(cfg, global_batch_size, padded_vocab_size, lora) \
        + 6 * b * s * layers * lora_layer_params(cfg, lora, 1)


def lora_flops_saved(cfg: ModelConfig, global_batch_size: int, padded_vocab_size: int, lora) -> float:
    """FLOPs of a full fine-tuning step that a LoRA step does not do, whole model:

    - every frozen weight's gradient GEMM (``2 B s`` per weight: every linear, the output layer);
    - in the first layer, everything before its first adapted projection has no backward at all
      (the frozen embedding's output needs no gradient): the input gradient of the linears before
      it and the core attention's backward (``2 x`` its forward) when the first adapted projection
      comes after it; at that projection itself, the base weight's and the ``A`` matrices' input
      gradients (``2 B s`` per weight).  With ``q_proj`` adapted: layer 0's ``linear_qkv`` input
      gradient and its adapters' ``2 B s r h`` each.  peft on transformers skips the same.
    """
    from mnb.estimate.params import lora_projections

    b, s, h = global_batch_size, cfg.seq_length, cfg.hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.query_groups * cfg.head_dim
    width = cfg.moe_ffn * cfg.moe_router_topk if cfg.is_moe else cfg.ffn
    forward = {  # forward FLOPs per token of one layer, in the order the layer runs them
        "linear_qkv": 2 * h * (q + 2 * kv),
        "attention": 4 * s * q,  # QK^T and AV, counted in full as above
        "linear_proj": 2 * q * h,
        "linear_fc1": 2 * h * width * (2 if cfg.gated_linear_unit else 1),
        "linear_fc2": 2 * width * h,
    }
    linear_weights = sum(v for k, v in forward.items() if k != "attention") / 2
    frozen_wgrad = 2 * b * s * (cfg.num_layers * linear_weights + h * padded_vocab_size)
    wanted = set(lora.resolved_targets(gpt2=not cfg.gated_linear_unit))
    adapted = [(megatron, n_in) for name, (n_in, _, _, megatron) in lora_projections(cfg).items()
               if name.strip() in wanted or megatron in wanted]
    order = list(forward)
    first = min((order.index(m) for m, _ in adapted), default=len(order))
    before = sum(forward[op] * (2 if op == "attention" else 1) for op in order[:first])
    at_first = 0
    if first < len(order):
        at_first = forward[order[first]] + sum(2 * lora.rank * n_in for m, n_in in adapted if m == order[first])
    return float(frozen_wgrad + b * s * (before + at_first))


def _peak(device: torch.device, train) -> dict:
    """A CPU rank's measured GEMM peak for the run's dtype (GPU ranks use the hardware table)."""
    if device.type != "cpu":
        return {}
    from mnb.megatron.peak import cpu_gemm_flops

    dtype = torch.bfloat16 if (train.bf16 or train.fp8) else torch.float32
    name = "float32" if dtype == torch.float32 else f"best of float32, {str(dtype)[6:]}"
    return {"peak_flops": cpu_gemm_flops(dtype), "peak_source": f"measured CPU GEMM peak ({name})"}


def _tokenizer_folder(model) -> str | None:
    """The Hugging Face folder of the model's own tokenizer (``%mnb export`` names it), or None."""
    folder = getattr(getattr(model, "tokenizer", None), "folder", None)
    return None if folder is None else str(folder)


def build_record(*, model, train, device: torch.device, num_microbatches: int, steps: list[dict],
                 timeline: list[dict], meter, components, flops: float) -> dict:
    import megatron.core

    from mnb.megatron import layout

    return {
        "rank": torch.distributed.get_rank(),
        "world_size": torch.distributed.get_world_size(),
        "coords": layout.coordinates(),
        "layout": model.parallel.as_dict(),
        "model": model.config.to_dict(),
        "lora": dataclasses.asdict(model.lora) if getattr(model, "lora", None) is not None else None,
        "tokenizer": _tokenizer_folder(model),
        "train": train.to_dict(),
        "device": "cpu" if device.type == "cpu" else f"cuda:{device.index}",
        "device_name": device_name(device),
        "num_microbatches": num_microbatches,
        "global_batch_size": train.micro_batch_size * model.parallel.dp * num_microbatches,
        "seq_length": model.config.seq_length,
        "num_parameters_local": model.num_parameters_local(),
        "padded_vocab_size": model.padded_vocab_size,
        "model_flops_per_step": flops,
        **_peak(device, train),
        "fusions": model.fusions,
        "steps": steps,
        "timeline": timeline,
        "memory": meter.summary(),
        "memory_source": meter.source,
        "memory_components": components.summary(
            meter.peak_allocated_bytes if meter.source == "cuda" else None),
        "megatron_core_version": getattr(megatron.core, "__version__", "unknown"),
    }


def describe_model(tconfig, chunks: list, seq_length: int) -> tuple[ModelConfig, int]:
    """A :class:`ModelConfig` (for FLOPs, estimates and plots) and the vocabulary of a user's model.

    Read from the model's Megatron ``TransformerConfig`` and, where the model is a
    language model (``GPTModel``: ``vocab_size``, ``max_sequence_length``,
    ``position_embedding_type``), from the model itself; a model without a vocabulary
    counts a vocabulary of 1 (no logits FLOPs to speak of).
    """
    lm = next((m for chunk in chunks for m in chunk.modules()
               if hasattr(m, "vocab_size") and hasattr(m, "max_sequence_length")), None)
    vocab = int(getattr(lm, "vocab_size", 1) or 1)
    activation = getattr(getattr(tconfig, "activation_func", None), "__name__", "")
    position = getattr(lm, "position_embedding_type", "learned_absolute")
    fields = dict(
        name=type(lm or chunks[0]).__name__,
        num_layers=tconfig.num_layers, hidden_size=tconfig.hidden_size,
        num_attention_heads=tconfig.num_attention_heads, num_query_groups=tconfig.num_query_groups,
        ffn_hidden_size=tconfig.ffn_hidden_size, kv_channels=tconfig.kv_channels, vocab_size=vocab,
        max_position_embeddings=max(int(getattr(lm, "max_sequence_length", 0) or 0), seq_length),
        seq_length=seq_length,
        normalization=tconfig.normalization if tconfig.normalization in ("LayerNorm", "RMSNorm") else "LayerNorm",
        gated_linear_unit=bool(tconfig.gated_linear_unit), activation="silu" if "silu" in activation else "gelu",
        position_embedding_type=position if position in ("learned_absolute", "rope") else "learned_absolute",
        add_bias_linear=bool(tconfig.add_bias_linear), num_moe_experts=tconfig.num_moe_experts,
        moe_router_topk=tconfig.moe_router_topk or 2, moe_ffn_hidden_size=tconfig.moe_ffn_hidden_size,
        share_embeddings_and_output_weights=bool(getattr(lm, "share_embeddings_and_output_weights", False)),
    )
    return ModelConfig(**fields), vocab


def loss_sum_and_count(losses_reduced: list) -> tuple[float, float]:
    """What a step's loss functions reported, as (sum, count) for an average.

    Megatron's schedules return, on the last pipeline stage, one dict per microbatch
    from ``loss_func``; the first key is the loss.  A 2-element value is Megatron-LM's
    per-token form ``[loss sum, number of tokens]``; a scalar is a microbatch's mean.
    """
    total, count = 0.0, 0.0
    for item in losses_reduced or []:
        if not isinstance(item, dict) or not item:
            continue
        value = torch.as_tensor(next(iter(item.values()))).detach().reshape(-1).to("cpu", torch.float64)
        if value.numel() == 2:
            total, count = total + float(value[0]), count + float(value[1])
        elif value.numel():
            total, count = total + float(value.mean()), count + 1.0
    return total, count
