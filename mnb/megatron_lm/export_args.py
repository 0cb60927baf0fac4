"""Megatron-LM's ``pretrain_gpt.py`` arguments for a resolved layout, and notes on what they cannot say.

The argument list behind every kind of :func:`mnb.export` (Megatron-LM's names are its own:
``megatron/training/arguments.py``; tests/test_exports.py runs its ``parse_args`` and
``validate_args`` on the result).  Pure Python: the notebook kernel never imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mnb.config import FP8_AMAX_HISTORY, TRANSFORMER_DEFAULTS, ModelConfig, ParallelConfig, TrainConfig
from mnb.estimate._inputs import padded_vocab_size
from mnb.model_source import tokenizer_vocab_size

_LM_FLAG_NAMES = {"num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
                  "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers"}
"""TransformerConfig names (``ModelConfig.extra``) whose Megatron-LM flag is spelt otherwise."""


def megatron_lm_args(model: ModelConfig, train: TrainConfig, layout: ParallelConfig, *,
                     tokenizer: str | None = None, data_prefix: str | None = None) -> tuple[list[str], list[str]]:
    """``pretrain_gpt.py`` arguments for a resolved layout, and notes on what they cannot say.

    Values mnb sets differently from Megatron-LM's defaults are written out (dropout 0,
    per-token loss, Adam betas, weight decay), so the cluster trains what the notebook did.
    ``tokenizer``: a Hugging Face checkpoint folder, named as ``--tokenizer-type
    HuggingFaceTokenizer --tokenizer-model FOLDER`` (else NullTokenizer with ``--vocab-size``).
    ``data_prefix``: the ``.bin/.idx`` prefix the notebook's ranks tokenized ``train.data`` into
    (text data), written as ``--data-path``; without it text data has no Megatron-LM form here.
    """
    a: list[tuple[str, Any]] = []
    notes: list[str] = []

    def add(flag: str, value: Any = None) -> None:
        a.append((flag, value))

    # model shape
    add("--num-layers", model.num_layers)
    add("--hidden-size", model.hidden_size)
    add("--ffn-hidden-size", model.ffn)
    add("--num-attention-heads", model.num_attention_heads)
    if model.kv_channels is not None:
        add("--kv-channels", model.kv_channels)
    if model.query_groups != model.num_attention_heads:
        add("--group-query-attention")
        add("--num-query-groups", model.query_groups)
    add("--seq-length", model.seq_length)
    add("--max-position-embeddings", model.max_position_embeddings)
    add("--position-embedding-type", model.position_embedding_type)
    if model.position_embedding_type == "rope":
        add("--rotary-base", model.rotary_base)
        if model.rope_scaling:  # Llama 3.x
            add("--use-rope-scaling")
            add("--rope-scaling-factor", model.rope_scaling_factor)
    add("--normalization", model.normalization)
    add("--norm-epsilon", model.layernorm_epsilon)
    if model.gated_linear_unit and model.activation == "silu":
        add("--swiglu")
    elif model.activation == "gelu_tanh" and not model.gated_linear_unit:
        add("--openai-gelu")  # GPT-2's tanh-approximated GELU
    elif model.gated_linear_unit or model.activation != "gelu":
        raise ValueError(f"Megatron-LM's arguments have no {'gated ' if model.gated_linear_unit else ''}"
                         f"{model.activation} MLP (only gelu, the tanh GELU and SwiGLU); change the model's activation")
    if not model.add_bias_linear:
        add("--disable-bias-linear")
        if model.add_qkv_bias:  # Qwen2
            add("--add-qkv-bias")
    if not model.share_embeddings_and_output_weights:
        add("--untie-embeddings-and-output-weights")
    add("--init-method-std", model.init_method_std)
    if model.is_moe:
        add("--num-experts", model.num_moe_experts)
        add("--moe-router-topk", model.moe_router_topk)
        add("--moe-ffn-hidden-size", model.moe_ffn)
        add("--moe-token-dispatcher-type", "alltoall" if layout.ep > 1 else "allgather")
    extra = {**TRANSFORMER_DEFAULTS, **model.extra}
    for name, value in extra.items():
        flag = "--" + _LM_FLAG_NAMES.get(name, name).replace("_", "-")
        if value is True:
            add(flag)
        elif value is False or value is None:
            notes.append(f"{name}={value!r} (ModelConfig.extra) has no Megatron-LM flag written here; check "
                         "that Megatron-LM's default matches")
        else:
            add(flag, value)
    # vocabulary and data
    if tokenizer is not None:
        add("--tokenizer-type", "HuggingFaceTokenizer")
        add("--tokenizer-model", tokenizer)
        notes.append(_weights_note(model, tokenizer))
    else:
        add("--tokenizer-type", "NullTokenizer")
        add("--vocab-size", model.vocab_size)
        padded = padded_vocab_size(model, layout.tp)
        if padded > model.vocab_size:
            notes.append(f"loss: Megatron-LM pads the vocabulary to {padded} (a multiple of 128 * tp) and its softmax "
                         f"counts the {padded - model.vocab_size} padding columns, which the notebook's loss hides: "
                         f"the losses differ by their share unless vocab_size is a multiple of {128 * layout.tp}")
    add("--make-vocab-size-divisible-by", 128)
    notes += _data_args(train.data, add, tokenizer, data_prefix)
    # parallelism
    add("--tensor-model-parallel-size", layout.tp)
    add("--pipeline-model-parallel-size", layout.pp)
    if layout.vpp > 1 and "pipeline_model_parallel_layout" not in model.extra:  # the layout gives vpp itself
        if {"num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"} & set(model.extra):
            add("--num-virtual-stages-per-pipeline-rank", layout.vpp)  # Megatron-LM's way with uneven stages
        else:
            add("--num-layers-per-virtual-pipeline-stage", model.num_layers // (layout.pp * layout.vpp))
    add("--context-parallel-size", layout.cp)
    if layout.cp > 1:
        notes.append(f"--context-parallel-size {layout.cp}: Megatron-LM needs Transformer Engine for cp > 1 "
                     "(its local attention asserts cp == 1); keep the default --transformer-impl "
                     "transformer_engine")
    add("--expert-model-parallel-size", layout.ep)
    if layout.sequence_parallel and layout.tp > 1:
        add("--sequence-parallel")
    if layout.fsdp is not None:
        notes += _fsdp_args(layout, train, add)
    # batch, schedule, optimizer
    add("--micro-batch-size", train.micro_batch_size)
    add("--global-batch-size", train.global_batch_size or train.micro_batch_size * layout.dp)
    add("--train-iters", train.schedule_length)  # the whole schedule, as the notebook's calls ran it
    add("--optimizer", "adam")
    add("--lr", train.lr)
    add("--min-lr", train.min_lr)
    add("--lr-decay-style", train.lr_decay_style)
    add("--lr-warmup-iters", train.warmup_steps)
    add("--lr-decay-iters", max(train.schedule_length, train.warmup_steps + 1))
    add("--weight-decay", train.weight_decay)
    add("--clip-grad", train.clip_grad)
    add("--adam-beta1", train.adam_beta1)
    add("--adam-beta2", train.adam_beta2)
    add("--calculate-per-token-loss")
    # precision and memory
    if train.bf16:
        add("--bf16")
    if train.fp8:
        add("--fp8-format", "hybrid")
        notes.append("--fp8-format hybrid needs Transformer Engine and Hopper-or-newer GPUs")
    elif model.fp8 is not None:
        notes += _fp8_args(model.fp8, add)
    if train.recompute == "selective":
        add("--recompute-granularity", "selective")
    elif train.recompute == "full":
        add("--recompute-granularity", "full")
        add("--recompute-method", "uniform")
        add("--recompute-num-layers", 1)
    if train.use_distributed_optimizer and layout.fsdp is None:  # _fsdp_args adds it under --fsdp
        add("--use-distributed-optimizer")
    add("--seed", train.seed)
    add("--log-interval", train.log_every)
    add("--eval-iters", 0)
    # pretrain() divides train_iters by it to count evaluation samples even with --eval-iters 0 (its default,
    # None, raises a TypeError before the first step; megatron-core 0.19.2)
    add("--eval-interval", train.schedule_length)
    if (layout.tp > 1 or layout.cp > 1) and layout.fsdp is None:
        notes.append("Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with tp or cp > 1 (before Blackwell): "
                     "export it in the job (the torchrun and slurm exports do)")
    elif layout.tp > 1 or layout.cp > 1:
        notes.append("tp or cp > 1 with --use-megatron-fsdp: Megatron-LM only warns (before Blackwell) that "
                     "their communication overlap wants CUDA_DEVICE_MAX_CONNECTIONS=1, which FSDP forbids")
    notes.append("the notebook's ranks used mnb's local spec (SDPA attention, torch norms); Megatron-LM "
                 "defaults to Transformer Engine: where TE and apex are missing add --transformer-impl local "
                 "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm"
                 + (" --no-rope-fusion" if model.position_embedding_type == "rope" else "")
                 + " (the torchrun script passes its own arguments on)")
    fresh = " (a fresh pool's first model is: the pool seeds it with 1234)" if train.seed == 1234 else ""
    if layout.pp > 1:  # Megatron-LM's _set_random_seed: seed + 100 * pipeline rank; mnb seeds every stage alike
        fresh += ("; under pp > 1 Megatron-LM seeds each pipeline stage with --seed + 100 x its rank, which the "
                  "notebook's ranks do not: their initial weights differ there")
    notes.append(f"initial weights: Megatron-LM draws them from --seed {train.seed} (its own per-rank "
                 "initialisation); mnb.gpt's default init='layout_invariant' draws other numbers from the same "
                 "distributions: for the notebook's losses step by step, build the model with mnb.gpt(..., "
                 f"init='megatron') right after mnb.megatron.layout.seed_ranks({train.seed}){fresh}")
    return [str(x) for flag, value in a for x in ((flag,) if value is None else (flag, value))], notes


def _fsdp_args(layout: ParallelConfig, train: TrainConfig, add) -> list[str]:
    """Megatron-LM's Megatron-FSDP arguments for ``ParallelConfig.fsdp`` and what they leave out.

    What ``validate_args`` (``megatron/training/arguments.py`` of core_v0.16.1 and core_v0.19.0) does
    under ``--use-megatron-fsdp``: asserts ``--ckpt-format fsdp_dtensor`` and CUDA_DEVICE_MAX_CONNECTIONS
    != 1 (so the launch scripts unset it: :func:`mnb.megatron_lm.exports.connections_line`), and warns to check
    Transformer Engine's fused gradient accumulation when gradients are sharded (mnb's ranks never fuse
    it: written off here).  0.19 forces the distributed optimizer (as mnb's ranks use it) and 0.16's
    default strategy is ``no_shard``, so both are written out whatever the version's defaults.
    Megatron-FSDP itself turns on the overlapped reduce-scatter / all-gather for these strategies,
    on the ranks as on the cluster, so no overlap flag is needed.
    """
    strategy = layout.fsdp
    add("--use-megatron-fsdp")
    add("--data-parallel-sharding-strategy", strategy)
    add("--use-distributed-optimizer")
    add("--ckpt-format", "fsdp_dtensor")
    if strategy != "optim":
        add("--no-gradient-accumulation-fusion")
    notes = [f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}: Megatron-LM asserts "
             "CUDA_DEVICE_MAX_CONNECTIONS is not 1 (the torchrun and slurm exports unset it) and "
             "--ckpt-format fsdp_dtensor (torch DCP checkpoints, which Megatron-LM reads back under "
             "--use-megatron-fsdp)"]
    if not train.use_distributed_optimizer:
        notes.append("--use-distributed-optimizer: Megatron-FSDP's optimizer is Megatron's distributed one "
                     "(the notebook's ranks used it too, use_distributed_optimizer=False notwithstanding)")
    notes.append("the notebook's ranks built each model whole before sharding it; for a model that fits "
                 "only sharded add --init-model-with-meta-device")
    if layout.dp * layout.cp == 1:
        notes.append(f"dp({layout.dp}) * cp({layout.cp}) = 1 on this target: Megatron-FSDP shards over those "
                     "ranks, so nothing is sharded; give it more GPUs or less tp")
    return notes


def _fp8_args(recipe: str, add) -> list[str]:
    """Megatron-LM's FP8 arguments for ``ModelConfig.fp8`` (mnb's FP8 linears) and how they differ.

    Megatron-LM runs FP8 only through Transformer Engine (``--fp8-format``, ``--fp8-recipe``:
    ``megatron/core/transformer/transformer_config.py``).  TE's ``tensorwise`` recipe is the same
    scaling as mnb's (per-tensor scales from the current tensor, E4M3 forward, E5M2 gradients under
    ``hybrid``); TE has no row-wise recipe, and ``blockwise`` (1x128 activation and 128x128 weight
    blocks, E4M3) is the nearest.  ``delayed`` is TE's ``delayed`` recipe with mnb's history
    (:data:`mnb.config.FP8_AMAX_HISTORY` casts, their max).
    """
    if recipe == "delayed":
        add("--fp8-format", "hybrid")
        add("--fp8-recipe", "delayed")
        add("--fp8-amax-history-len", str(FP8_AMAX_HISTORY))
        add("--fp8-amax-compute-algo", "max")
        return [f"--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len {FP8_AMAX_HISTORY} "
                "--fp8-amax-compute-algo max: Transformer Engine's delayed scaling, the notebook's fp8='delayed'; TE "
                "keeps a history for each weight too (mnb scales each weight by its own amax, once a step); it needs "
                "TE and Hopper-or-newer GPUs"]
    if recipe == "tensorwise":
        add("--fp8-format", "hybrid")
        add("--fp8-recipe", "tensorwise")
        return ["--fp8-format hybrid --fp8-recipe tensorwise: Transformer Engine's current (per-tensor) scaling, "
                "the notebook's fp8='tensorwise'; it needs TE and Hopper-or-newer GPUs, and TE also runs the "
                "output layer's and attention's neighbours as it chooses (mnb keeps the logits in bf16)"]
    add("--fp8-format", "e4m3")
    add("--fp8-recipe", "blockwise")
    return ["--fp8-format e4m3 --fp8-recipe blockwise: Transformer Engine has no row-wise recipe; its block scaling "
            "(1x128 activations, 128x128 weights, E4M3) is the nearest to the notebook's fp8='rowwise' (one "
            "scale per row); it needs TE and Hopper GPUs"]


def _weights_note(model: ModelConfig, tokenizer: str) -> str:
    """What the arguments say about a Hugging Face checkpoint: its shape and tokenizer, not its weights."""
    size = tokenizer_vocab_size(tokenizer)
    vocab = ""
    if size is not None and size != model.vocab_size:
        vocab = (f"; Megatron-LM sizes the embedding from the tokenizer ({size} ids, padded to a multiple of "
                 f"128 * tp), the checkpoint has {model.vocab_size} rows")
    return (f"model: the shape and tokenizer of the Hugging Face checkpoint {tokenizer}; pretrain_gpt.py "
            f"starts from random weights (its weights are not converted here){vocab}")


def _data_args(data: str, add, tokenizer: str | None = None, data_prefix: str | None = None) -> list[str]:
    """Megatron-LM's data arguments for mnb's ``data=`` and what they leave out.

    Megatron-LM's ``GPTDataset`` with ``--seed`` and ``--split 100,0,0`` draws the same sample order
    as the notebook's ranks (same class, same seed) as long as the run stays within one epoch of the
    data: mnb numbers later epochs itself (:class:`mnb.megatron.batches.EpochSamples`)."""
    reader = "the checkpoint's tokenizer" if tokenizer else "NullTokenizer (token ids as stored)"
    if data_prefix is not None and data != "mock":
        add("--data-path", data_prefix)
        add("--split", "100,0,0")
        made = "the checkpoint's tokenizer" if tokenizer else "mnb's byte tokenizer (UTF-8 bytes, eod 256)"
        return [f"data: the notebook's {data!r} as its ranks tokenized it with {made}: {data_prefix}.bin/.idx "
                "(copy both files where the cluster reads them and change --data-path); the sample order is "
                "the notebook's while the run stays within one epoch of it"]
    if data.endswith((".bin", ".idx")) or Path(data + ".bin").is_file():
        prefix = data[:-4] if data.endswith((".bin", ".idx")) else data
        add("--data-path", prefix)
        add("--split", "100,0,0")
        return [f"data: {prefix}.bin/.idx, read with {reader}"]
    add("--mock-data")
    if data == "mock":
        return ["data: synthetic tokens (--mock-data); for real data use --data-path PREFIX (a Megatron "
                ".bin/.idx) and its tokenizer"]
    build = f"prepare({data!r}, model.tokenizer)" if tokenizer else f"prepare({data!r})"
    return [f"data: the notebook trained on {data!r}, which Megatron-LM cannot read: --mock-data stands in; "
            f"build its .bin/.idx on a rank with mnb.megatron.data.{build} and pass --data-path PREFIX"]
