"""Configuration dataclasses shared by both sides of mnb: the model and the training.

One source of defaults: the magics, the widgets, the estimators and the
rank-side Megatron code all read the same dataclasses (the layout's,
:class:`ParallelConfig`, is in :mod:`mnb.parallel_config`; re-exported here, as are
:class:`LoraConfig`, the presets' and paths' functions and ``parse_steps``).  Validation runs
on the notebook side before any rank is touched, and every message carries
the numbers that broke the rule, so the user knows what to change.

Field names of :class:`ModelConfig` are Megatron-Core's own
(``TransformerConfig`` and ``GPTModel`` arguments), so overrides such as
``mnb.gpt("tiny", num_layers=8)`` read like Megatron code.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from mnb.fields import check_fields
from mnb.lora_config import LORA_ALL, LORA_HF_TARGETS, LORA_MEGATRON_TARGETS, LoraConfig, lora_config  # noqa: F401
from mnb.parallel_config import (FSDP_OPTIM_ON_CPU, FSDP_STRATEGIES, ParallelConfig, as_vpp,  # noqa: F401
                                 divisors)
from mnb.paths import cache_dir, package_data  # noqa: F401  (their old import path; mnb.paths owns them)
from mnb.pipeline_layout import parse_pipeline_layout, uneven_pipeline_layout  # noqa: F401
from mnb.presets import preset_fields, preset_names  # noqa: F401  (preset_names: its old import path)
from mnb.profile_steps import parse_steps  # noqa: F401  (its old import path; mnb.profile_steps owns it)


def _positive(obj: Any, names: tuple[str, ...]) -> None:
    """Each named field (already type-checked) at least 1 unless None."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


FP8_TE_SPELLING = (
    "fp8={value!r} is Transformer Engine's FP8 (mnb.train(..., fp8=True) with TE installed); on mnb's local "
    "spec, without TE, build the model with fp8='tensorwise' (E4M3 forward, E5M2 gradients), fp8='rowwise' "
    "(E4M3 with per-row scales) or fp8='delayed' (TE's delayed scaling): mnb.gpt(..., fp8='tensorwise')"
)
"""Why ``ModelConfig.fp8`` refuses TE's spellings (``True``, ``'hybrid'``, ``'e4m3'``)."""
FP8_AMAX_HISTORY = 16
"""``fp8="delayed"``: the casts of one kind of tensor of one linear whose amaxes set the next scale (their max;
Transformer Engine's ``amax_history_len`` with ``amax_compute_algo="max"``).  Inside a training step a
linear's input is cast once per micro batch, so 16 reaches back one to two steps."""

TRANSFORMER_DEFAULTS: dict[str, Any] = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
"""TransformerConfig values mnb changes from Megatron's defaults (overridable through ``extra``).

Here, not in the rank-side model code, so that an export to Megatron-LM (:mod:`mnb.megatron_lm.exports`)
writes the same values the ranks trained with."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT-style model, with Megatron-Core's field names.

    Presets are JSON files in templates/presets/ (see :func:`load_preset`).
    """

    name: str = "custom"
    """The preset's or checkpoint's name, shown in summaries, plans and exports."""
    num_layers: int = 2
    """Transformer layers (blocks)."""
    hidden_size: int = 64
    """Width of the residual stream (the embedding size)."""
    num_attention_heads: int = 4
    """Query heads per layer; must be divisible by tp."""
    num_query_groups: int | None = None
    """Grouped-query attention groups (None = multi-head attention)."""
    ffn_hidden_size: int | None = None
    """MLP width; None = 4 * hidden_size."""
    kv_channels: int | None = None
    """Per-head dimension; None = hidden_size / num_attention_heads."""
    vocab_size: int = 256
    """Tokens in the vocabulary (256 = mnb's byte tokenizer; a checkpoint's tokenizer sets its own)."""
    max_position_embeddings: int = 128
    """Longest sequence the position embedding covers (learned positions: the table's rows)."""
    seq_length: int = 128
    """Tokens per training sample (at most ``max_position_embeddings`` with learned positions)."""
    sliding_window: int | None = None
    """Tokens a query attends back to, itself included (Mistral's ``sliding_window``); None = the whole
    causal past.  Megatron's local attention has no window, so a model with one runs only sequences no longer
    than it: ``seq_length``, :func:`mnb.logits`'s tokens and :func:`mnb.generate`'s prompt plus new tokens are
    refused past it (where the window cannot matter)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """'LayerNorm' (GPT-2: mean and variance, with bias) or 'RMSNorm' (Llama, Qwen2, Mixtral: scale only)."""
    gated_linear_unit: bool = False
    """True with activation 'silu' is SwiGLU (Llama)."""
    activation: Literal["gelu", "gelu_tanh", "silu"] = "gelu"
    """The MLP's activation: 'gelu' (exact GELU), 'gelu_tanh' (the tanh-approximated GELU: GPT-2's
    ``gelu_new``, Megatron-LM's ``--openai-gelu``) or 'silu' (with ``gated_linear_unit``: SwiGLU)."""
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    """'learned_absolute' (a learned table per position, GPT-2) or 'rope' (rotary embeddings on q
    and k, Llama)."""
    rotary_base: int = 10000
    """RoPE's base period (Llama 3: 500000)."""
    rope_scaling: bool = False
    """Llama 3's RoPE frequency scaling (GPTModel's ``rope_scaling``; low/high frequency factors 1 and 4,
    original context 8192, as Megatron-Core fixes them)."""
    rope_scaling_factor: float = 8.0
    """Llama 3's RoPE scaling factor (used with ``rope_scaling``)."""
    share_embeddings_and_output_weights: bool = False
    """Tie the output layer to the input embedding (GPT-2, small Qwen2s)."""
    add_bias_linear: bool = True
    """Biases on every linear layer (GPT-2); False for Llama-style models."""
    add_qkv_bias: bool = False
    """Biases on the q/k/v projection only (Qwen2); ``add_bias_linear`` biases every linear layer."""
    num_moe_experts: int | None = None
    """Experts per MoE layer; None = a dense MLP."""
    moe_router_topk: int = 2
    """Experts each token is routed to (MoE models)."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's MLP width; None = ``ffn_hidden_size``."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation of the weights."""
    layernorm_epsilon: float = 1e-5
    """The epsilon of LayerNorm / RMSNorm."""
    fp8: Literal["tensorwise", "rowwise", "delayed"] | None = None
    """FP8 GEMMs in the transformer layers' parallel linears on the local spec, without Transformer
    Engine (:mod:`mnb.megatron.fp8`): ``"tensorwise"`` (E4M3 forward, E5M2 gradients, one scale per
    tensor), ``"rowwise"`` (E4M3, one scale per row) or ``"delayed"`` (tensorwise's formats, activation and
    gradient scales from an amax history while training: Transformer Engine's default); None = bf16.  Needs a GPU with FP8 tensor cores
    (compute capability >= 8.9) and bf16 training.  Not Megatron's ``TransformerConfig.fp8`` (TE's
    format: ``TrainConfig.fp8``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further TransformerConfig fields passed through unchanged."""

    def __post_init__(self) -> None:
        if self.fp8 is False:
            object.__setattr__(self, "fp8", None)
        if self.fp8 is True or self.fp8 in ("e4m3", "hybrid"):
            raise ValueError(FP8_TE_SPELLING.format(value=self.fp8))
        check_fields(self)
        if self.fp8 is not None and self.num_moe_experts:
            raise ValueError(
                f"fp8={self.fp8!r} covers dense models: the experts of an MoE layer get token counts that "
                "torch._scaled_mm cannot take unpadded; drop fp8= for this model")
        _positive(self, ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                         "max_position_embeddings", "num_query_groups", "ffn_hidden_size", "kv_channels",
                         "rotary_base", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size"))
        if self.hidden_size % self.num_attention_heads and self.kv_channels is None:
            raise ValueError(
                f"hidden_size({self.hidden_size}) is not divisible by "
                f"num_attention_heads({self.num_attention_heads}); set kv_channels explicitly"
            )
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads({self.num_attention_heads}) is not divisible by "
                f"num_query_groups({self.num_query_groups})"
            )
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(
                f"seq_length({self.seq_length}) exceeds max_position_embeddings"
                f"({self.max_position_embeddings})"
            )
        if self.num_moe_experts is not None and not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(
                f"moe_router_topk({self.moe_router_topk}) must be between 1 and "
                f"num_moe_experts({self.num_moe_experts})"
            )
        if self.num_moe_experts is not None and self.moe_router_topk == 1 and not self.extra.get("moe_router_pre_softmax"):
            raise ValueError(
                "moe_router_topk=1 routes each token to one expert with weight 1 (a softmax over the chosen expert "
                "alone), which gives the router no gradient, so Megatron-Core refuses it: route to 2 or more "
                "experts, or pass moe_router_pre_softmax=True (the softmax over all experts, then the top one)")
        if self.sliding_window is not None:
            _positive(self, ("sliding_window",))
            if self.seq_length > self.sliding_window:
                raise ValueError(
                    f"seq_length({self.seq_length}) exceeds sliding_window({self.sliding_window}): Megatron's local "
                    "attention has no sliding window, so mnb runs this model on sequences no longer than its window; "
                    f"pass seq_length<={self.sliding_window}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def layers_per_stage(self, pp: int, vpp: int = 1) -> list[int]:
        """Transformer layers on each pipeline stage (rank), as Megatron splits them.

        Even unless ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``
        fix the end stages (the other stages then share the rest evenly) or
        ``pipeline_model_parallel_layout`` names every virtual stage's layers (TransformerConfig
        names, kept in ``extra``; see :meth:`layers_per_virtual_stage`).  ValueError with the
        numbers when the split does not work out.
        """
        return [sum(chunks) for chunks in self.layers_per_virtual_stage(pp, vpp)]

    def layers_per_virtual_stage(self, pp: int, vpp: int = 1) -> list[list[int]]:
        """Transformer layers of each rank's model chunks: ``[rank][chunk]``.

        With ``pipeline_model_parallel_layout`` (Megatron-Core's string, e.g.
        ``"Ettt|(tttt|)*30,tttL"``, or its list of lists) the layout decides, its virtual
        stages ``pp * vpp`` in order (rank ``i % pp``, chunk ``i // pp``) and ``vpp`` is the
        layout's (:meth:`check_parallel` checks the ParallelConfig's against it).  This is how
        Megatron-Core combines uneven end stages with interleaving: its
        ``num_layers_in_first/last_pipeline_stage`` need a multiple of vpp layers
        (:func:`uneven_pipeline_layout` writes the layout that does what they cannot).
        """
        layout = self.extra.get("pipeline_model_parallel_layout")
        if layout is not None:
            if self.extra.get("num_layers_in_first_pipeline_stage") is not None or \
                    self.extra.get("num_layers_in_last_pipeline_stage") is not None:
                raise ValueError("pipeline_model_parallel_layout cannot be set with num_layers_in_first/last_"
                                 "pipeline_stage (Megatron-Core refuses both); keep the layout")
            stages = parse_pipeline_layout(layout, pp)
            decoders = sum(stage.count("t") for stage in stages)
            if decoders != self.num_layers:
                raise ValueError(f"pipeline_model_parallel_layout has {decoders} decoder layers ('t'), "
                                 f"the model num_layers({self.num_layers})")
            chunks = len(stages) // pp
            return [[stages[c * pp + r].count("t") for c in range(chunks)] for r in range(pp)]
        first = self.extra.get("num_layers_in_first_pipeline_stage")
        last = self.extra.get("num_layers_in_last_pipeline_stage")
        if pp == 1 or (first is None and last is None):
            if self.num_layers % (pp * vpp):
                raise ValueError(f"num_layers({self.num_layers}) is not divisible by pp({pp}) * vpp({vpp}) = "
                                 f"{pp * vpp}")
            return [[self.num_layers // (pp * vpp)] * vpp for _ in range(pp)]
        ends = [n for n in (first, last) if n is not None]
        middle = pp - len(ends)
        rest = self.num_layers - sum(ends)
        named = (f"num_layers({self.num_layers}) with num_layers_in_first_pipeline_stage={first}, "
                 f"num_layers_in_last_pipeline_stage={last} under pp({pp}) * vpp({vpp})")
        if any(n < 1 for n in ends) or rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
            raise ValueError(f"{named}: the other {middle} stage(s) need an equal share of the remaining {rest}")
        if any(n % vpp for n in ends) or (middle and rest // middle % vpp):
            hint = ""
            try:
                hint = (f"; for uneven stages with interleaving set pipeline_model_parallel_layout="
                        f"{uneven_pipeline_layout(self.num_layers, pp, vpp, first=first, last=last)!r} "
                        "instead (Megatron-Core's per-virtual-stage layout)")
            except ValueError:
                pass
            raise ValueError(f"{named}: Megatron-Core needs a multiple of vpp layers on each stage{hint}")
        share = rest // middle if middle else 0
        per_rank = [first if first is not None else share] + [share] * (pp - 2) + [last if last is not None else share]
        return [[n // vpp] * vpp for n in per_rank]

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """A ModelConfig from a dict of its fields (a run record's ``"model"``, a user's dict).

        The one rule for a model dict, used by the estimators, the explorer, export and runs:
        its keys must be ModelConfig fields (``extra`` holds TransformerConfig names); any
        other key is refused with the names, where a preset's overrides
        (``mnb.gpt("tiny", hidden_dropout=0.1)``) send unknown names to ``extra``.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"model dict has unknown key(s) {unknown}; use ModelConfig fields "
                             f"({', '.join(sorted(known))}), and put TransformerConfig names in 'extra'")
        return cls(**data)

    def with_overrides(self, **overrides: Any) -> "ModelConfig":
        """Copy with Megatron-named overrides; unknown names go to ``extra``."""
        known = {f.name for f in fields(self)}
        direct = {k: v for k, v in overrides.items() if k in known}
        extra = {k: v for k, v in overrides.items() if k not in known}
        if "seq_length" in direct and "max_position_embeddings" not in direct:
            direct["max_position_embeddings"] = max(self.max_position_embeddings, direct["seq_length"])
        merged_extra = {**self.extra, **extra}
        return replace(self, **direct, extra=merged_extra)

    def num_parameters(self) -> int:
        """Total parameters of the whole (unsharded) model, counted like Megatron."""
        h, layers = self.hidden_size, self.num_layers
        q = self.num_attention_heads * self.head_dim
        kv = 2 * self.query_groups * self.head_dim
        attn = h * (q + kv) + q * h
        mlp_in = self.ffn * h * (2 if self.gated_linear_unit else 1)
        dense_mlp = mlp_in + self.ffn * h
        if self.is_moe:
            moe_in = self.moe_ffn * h * (2 if self.gated_linear_unit else 1)
            mlp = self.num_moe_experts * (moe_in + self.moe_ffn * h) + h * self.num_moe_experts
        else:
            mlp = dense_mlp
        norms = 2 * h * (1 if self.normalization == "RMSNorm" else 2)
        biases = 0
        if self.add_bias_linear:
            biases = (q + kv) + h + (self.ffn * (2 if self.gated_linear_unit else 1)) + h
        elif self.add_qkv_bias:
            biases = q + kv
        per_layer = attn + mlp + norms + biases
        embed = self.vocab_size * h
        pos = self.max_position_embeddings * h if self.position_embedding_type == "learned_absolute" else 0
        output = 0 if self.share_embeddings_and_output_weights else self.vocab_size * h
        final_norm = h * (1 if self.normalization == "RMSNorm" else 2)
        return layers * per_layer + embed + pos + output + final_norm

    def check_parallel(self, parallel: ParallelConfig) -> None:
        """Raise ValueError if this model cannot be split as ``parallel`` says."""
        if self.num_attention_heads % parallel.tp:
            raise ValueError(
                f"num_attention_heads({self.num_attention_heads}) is not divisible by "
                f"tp({parallel.tp}); choose tp from {divisors(self.num_attention_heads)}"
            )
        if self.query_groups % parallel.tp:
            raise ValueError(
                f"num_query_groups({self.query_groups}) is not divisible by tp({parallel.tp}); "
                f"choose tp from {divisors(self.query_groups)}"
            )
        self.layers_per_stage(parallel.pp, parallel.vpp)  # raises with the numbers
        layout = self.extra.get("pipeline_model_parallel_layout")
        if layout is not None:
            chunks = len(parse_pipeline_layout(layout, parallel.pp)) // parallel.pp
            if chunks != parallel.vpp:
                raise ValueError(f"pipeline_model_parallel_layout has {chunks * parallel.pp} virtual stages = "
                                 f"pp({parallel.pp}) x {chunks}, and vpp is {parallel.vpp}: set vpp={chunks}")
        if parallel.ep > 1 and not self.is_moe:
            raise ValueError(f"ep({parallel.ep}) needs an MoE model; '{self.name}' has no experts")
        if self.is_moe and self.num_moe_experts % parallel.ep:
            raise ValueError(
                f"num_moe_experts({self.num_moe_experts}) is not divisible by ep({parallel.ep})"
            )
        if parallel.sequence_parallel and self.seq_length % parallel.tp:
            raise ValueError(
                f"seq_length({self.seq_length}) is not divisible by tp({parallel.tp}) "
                "under sequence parallel"
            )
        if parallel.cp > 1 and self.seq_length % (2 * parallel.cp):
            raise ValueError(
                f"seq_length({self.seq_length}) is not divisible by 2 * cp({parallel.cp}) = "
                f"{2 * parallel.cp}"
            )
        local = self.seq_length // parallel.cp
        if parallel.cp > 1 and parallel.sequence_parallel and local % parallel.tp:
            raise ValueError(
                f"seq_length({self.seq_length}) / cp({parallel.cp}) = {local} tokens per cp rank are "
                f"not divisible by tp({parallel.tp}) under sequence parallel"
            )
        if self.vocab_size < 1:
            raise ValueError("vocab_size must be positive")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run: batch sizes, schedule, precision and memory savers.

    The learning-rate schedule (warm-up, then constant / linear / cosine decay to
    ``min_lr``) spans ``schedule_steps`` steps counted from the model's first step;
    ``mnb.train`` keeps it, and its step count, with the model's optimizer (and
    ``mnb.save`` in the checkpoint), so a later call continues it.
    """

    steps: int = 10
    """Steps of this call."""
    schedule_steps: int | None = None
    """Length of the whole learning-rate schedule, from the model's first step, when it is longer
    than this call (e.g. ``steps=5, schedule_steps=10``, then ``steps=5`` again).  None: this call's
    ``steps`` on a model's first call, the model's own schedule on later calls."""
    micro_batch_size: int = 1
    """Sequences per microbatch on each data-parallel rank."""
    global_batch_size: int | None = None
    """None = micro_batch_size * dp (one microbatch per step)."""
    lr: float = 3e-4
    """Peak learning rate (after warm-up)."""
    min_lr: float = 0.0
    """Where decay ends (lr_decay_style 'linear' or 'cosine')."""
    warmup_steps: int = 0
    """Linear warm-up from 0 (the first step runs at lr 0, as in Megatron-LM)."""
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    """After warm-up: 'constant' (stay at ``lr``), 'cosine' or 'linear' (decay to ``min_lr`` at the
    schedule's end)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.95
    """Adam's second-moment decay."""
    bf16: bool = False
    """bf16 weights and activations with fp32 master weights and gradients (Megatron's mixed precision)."""
    fp8: bool = False
    """FP8 GEMMs through Transformer Engine ('hybrid': E4M3 forward, E5M2 gradients, delayed scaling);
    needs TE and a Hopper-or-newer GPU.  Without TE, build the model with FP8 linears instead:
    ``mnb.gpt(..., fp8="tensorwise" | "rowwise" | "delayed")`` (:attr:`ModelConfig.fp8`)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: 'none' (keep every activation), 'selective' (recompute core
    attention in backward, Megatron's default granularity), 'full' (keep only each layer's input and
    recompute the whole layer in backward)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state over the data-parallel ranks (Megatron's distributed optimizer, ZeRO-1)."""
    seed: int = 1234
    """Seed of the initial weights, dropout and mock data; the same in every layout."""
    data: str = "mock"
    """'mock', a corpus preset such as 'stdlib', a folder/glob of text files, a .bin/.idx prefix, or
    instruction rows: ``.jsonl`` files of ``{"prompt", "completion"}`` or ``{"messages": [...]}``
    (the loss on completions / assistant turns only; docs/hf.md)."""
    pack: bool = True
    """Instruction data: several examples per sequence, each attending to itself alone, where the layout
    can isolate them (not under cp > 1: one example per sequence, padded); False: always one per sequence."""
    truncate: bool = False
    """Instruction data: cut rows longer than a sequence (seq_length + 1 tokens) instead of refusing them."""
    log_every: int = 1
    """Print the progress line every this many steps."""
    eval_data: str | None = None
    """Held-out data for ``mnb.evaluate`` during training (what ``data`` takes); None = no evaluation."""
    eval_every: int = 0
    """Evaluate after every this many steps of the call (0 = once, after the last step)."""
    eval_batches: int = 1
    """Batches (micro_batch_size sequences per dp rank each) per evaluation."""

    def __post_init__(self) -> None:
        if isinstance(self.fp8, str):
            raise ValueError(
                f"fp8={self.fp8!r} is how the model's linears are built on the local spec: pass it to "
                f"mnb.gpt(..., fp8={self.fp8!r}) (ModelConfig.fp8); mnb.train's fp8=True is Transformer Engine's "
                "recipe")
        check_fields(self)
        _positive(self, ("steps", "schedule_steps", "micro_batch_size", "global_batch_size", "log_every"))
        if not 0 < self.lr < float("inf"):  # nan and inf too: nan failed later as "min_lr must be ... lr(nan)"
            raise ValueError(f"lr must be a positive, finite number, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be between 0 and lr({self.lr}), got {self.min_lr}")
        for name in ("warmup_steps", "weight_decay", "clip_grad"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ValueError(f"eval_every must be an integer >= 0 (0 = after the last step), got {self.eval_every!r}")
        for name in ("pack", "truncate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.eval_batches, int) or self.eval_batches < 1:
            raise ValueError(f"eval_batches must be a positive integer, got {self.eval_batches!r}")
        if self.schedule_steps is not None:
            self.check_schedule(self.schedule_steps)

    @property
    def schedule_length(self) -> int:
        """The schedule's length as this config alone says it: ``schedule_steps``, else ``steps``."""
        return self.schedule_steps or self.steps

    def check_schedule(self, length: int | None = None) -> None:
        """The warm-up rule: a decaying schedule of ``length`` steps (default :attr:`schedule_length`)
        must warm up in fewer steps than it has.  Training, export and the explorer ask here."""
        length = self.schedule_length if length is None else length
        if self.lr_decay_style != "constant" and self.warmup_steps >= length:
            raise ValueError(
                f"warmup_steps({self.warmup_steps}) must be smaller than the schedule's {length} steps "
                f"(schedule_steps, else steps) for lr_decay_style={self.lr_decay_style!r}; warm up for "
                "fewer steps or make the schedule longer with schedule_steps=..."
            )

    def eval_due(self, step: int) -> bool:
        """Whether to evaluate after ``step`` (1-based within the call)."""
        if not self.eval_data:
            return False
        return step % self.eval_every == 0 if self.eval_every else step == self.steps

    def num_microbatches(self, dp: int) -> int:
        """Microbatches per step per data-parallel rank, checked for divisibility (:func:`batch_problem`)."""
        gbs = self.global_batch_size or self.micro_batch_size * dp
        problem = batch_problem(gbs, self.micro_batch_size, dp)
        if problem:
            raise ValueError(problem)
        return gbs // (self.micro_batch_size * dp)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def batch_problem(global_batch_size: int, micro_batch_size: int, dp: int) -> str:
    """Why a global batch does not split into microbatches of ``micro_batch_size`` on ``dp`` replicas
    ('' when it does): the one statement of the rule, for training, export, the explorer and the plan."""
    per_step = micro_batch_size * dp
    if global_batch_size % per_step == 0:
        return ""
    low = max(per_step, global_batch_size - global_batch_size % per_step)
    return (f"global_batch_size({global_batch_size}) is not divisible by micro_batch_size({micro_batch_size}) * "
            f"dp({dp}) = {per_step}; use a multiple of {per_step} (e.g. {low} or {low + per_step}), another "
            "micro batch size, or another layout")


TRAIN_CALL_EXTRAS = ("forward_step_func", "data_iterator", "seq_length", "profile")
"""``mnb.train``'s keyword arguments that are not :class:`TrainConfig` fields."""


def train_settings_problem(names) -> str:
    """Why ``mnb.train`` does not take settings named ``names`` ('' when it takes them all): the one statement
    of the rule, for the ranks and for the %%megatron check before a cell runs."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(names) - known - set(TRAIN_CALL_EXTRAS))
    return f"train() got unknown settings {unknown}; valid: {sorted(known)}" if unknown else ""


def interleave_problem(num_microbatches: int, pp: int, vpp: int, per_microbatch: int | None = None) -> str:
    """Why Megatron-Core's interleaved 1F1B schedule (``vpp > 1``) refuses ``num_microbatches`` ('' when it takes
    them): it runs microbatches in groups of pp (``microbatch_group_size_per_vp_stage``'s default), needs at
    least one group and refuses a last group shorter than pp, so the count must be a multiple of pp.  The one
    statement of the rule, for training, the %%megatron check, the estimators, the explorer and the plan.
    ``per_microbatch``: samples a microbatch adds to the global batch (micro_batch_size * dp), for the hint."""
    if vpp <= 1 or (num_microbatches >= pp and num_microbatches % pp == 0):
        return ""
    hint = ""
    if per_microbatch:
        low = max(pp, num_microbatches - num_microbatches % pp)
        hint = f"; use global_batch_size {low * per_microbatch} or {(low + pp) * per_microbatch}, or another layout"
    return (f"the interleaved pipeline schedule (vpp={vpp}) runs microbatches in groups of pp({pp}), and "
            f"num_microbatches({num_microbatches}) is not a multiple of {pp} (Megatron-Core refuses it){hint}")


def load_preset(name: str) -> ModelConfig:
    """Read a model preset (templates/presets/NAME.json, :mod:`mnb.presets`) into a ModelConfig."""
    return ModelConfig(name=name, **preset_fields(name))


def model_config(preset_or_config: str | ModelConfig | dict, **overrides: Any) -> ModelConfig:
    """A ModelConfig from a preset name, a dict of fields, or a ModelConfig, plus overrides."""
    if isinstance(preset_or_config, ModelConfig):
        base = preset_or_config
    elif isinstance(preset_or_config, str):
        base = load_preset(preset_or_config)
    elif isinstance(preset_or_config, dict):
        base = ModelConfig.from_dict(preset_or_config)
    else:
        raise TypeError(
            f"expected a preset name, a dict or a ModelConfig, got {type(preset_or_config).__name__}"
        )
    return base.with_overrides(**overrides) if overrides else base
