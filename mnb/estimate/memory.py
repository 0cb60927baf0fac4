"""Per-rank, per-pipeline-stage memory: weights, gradients, optimizer, activations.

Sources:

- Weights + gradients + optimizer: mixed-precision Adam keeps bf16 weights
  (2 B), fp32 gradients (4 B, Megatron-LM's default for bf16) and fp32 master
  weights + Adam m + v (12 B): 18 B/param; the distributed optimizer shards the
  12 B over the data-parallel ranks: 6 + 12/dp (Megatron-LM
  theoretical_memory_usage.py; Rajbhandari et al. 2020, ZeRO stage 1).  fp32
  training: 4 + 4 + 8 = 16 B/param (8 + 8/dp sharded).  Megatron-FSDP's levels
  (``ParallelConfig.fsdp``) shard gradients and parameters too, and ZeRO-3 holds
  a few layers gathered: :mod:`mnb.estimate.sharding`.
- Activations: :mod:`mnb.estimate.activations` (Korthikanti et al. 2022) times
  the microbatches a stage holds in flight (:func:`mnb.estimate.pipeline.in_flight`:
  1F1B stage r holds min(pp - r, m); interleaving's factor 1 + (pp-1)/(pp*vpp)).

Beyond Megatron-LM's estimator (first stage only): every stage, embedding on
the first / output layer on the last, logits (s*b*V/tp on the last stage, plus
the fp32 softmax Megatron's unfused vocab-parallel cross entropy keeps), MoE experts split by
ep, full recompute, context parallelism (the sequence / cp on every rank, plus the K/V of the
whole sequence that mnb's all-gather cp attention keeps per layer; TE's ring attention, used
when TE is installed, keeps less), and a small allocator/workspace overhead ("other").

    >>> import mnb.estimate as est
    >>> from mnb.config import ParallelConfig, TrainConfig
    >>> from mnb.units import GIB
    >>> m = est.memory("llama-7b", ParallelConfig(), TrainConfig(bf16=True,
    ...                use_distributed_optimizer=True, global_batch_size=128), gpus=8)
    >>> round(m.peak_bytes / GIB)   # on the fullest rank
    67
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mnb.config import LoraConfig, ModelConfig, ParallelConfig, TrainConfig, interleave_problem, lora_config
from mnb.units import Text, format_bytes

from . import hardware
from ._inputs import as_model, as_parallel, as_train, dropout, padded_vocab_size
from ._inputs import num_microbatches as resolve_microbatches
from .activations import LayerShape, full_layer_bytes, layer_activation_bytes, norm_extra_bytes
from .params import lora_layer_params, stage_params
from .pipeline import in_flight
from .sharding import (
    ADAM_STATE_BYTES, MAIN_WEIGHT_BYTES, gathered_params, level_name, sharded_components, unsharded_bytes_per_param,
)

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "other")
"""Component names, in stacking order (``other`` includes the logits)."""


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Predicted memory of any one rank in pipeline stage ``stage``, in bytes."""

    stage: int
    num_layers: int
    params: int
    """Parameters on one rank of this stage."""
    in_flight_microbatches: int
    """(chunk, microbatch) activation sets held at the peak."""
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    gathered_weights_bytes: float = 0.0
    """Part of ``weights_bytes``: parameters ZeRO-3 (``fsdp="optim_grads_params"``) holds gathered beside
    its shards (:func:`mnb.estimate.sharding.gathered_params`)."""
    recomputed_bytes: float = 0.0
    """Part of ``activations_bytes``: the layer full recompute rematerialises during its
    backward (held only then, not between forward and backward)."""
    logits_bytes: float
    other_bytes: float
    """Allocator/workspace overhead (``overhead_fraction`` of activations + logits)."""

    @property
    def total_bytes(self) -> float:
        return (
            self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
            + self.activations_bytes + self.logits_bytes + self.other_bytes
        )

    def components(self) -> dict[str, float]:
        """The five stacked components of the plots (logits folded into ``other``)."""
        return {
            "weights": self.weights_bytes,
            "gradients": self.gradients_bytes,
            "optimizer": self.optimizer_bytes,
            "activations": self.activations_bytes,
            "other": self.logits_bytes + self.other_bytes,
        }


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Predicted memory per pipeline stage; every rank of a stage holds the same."""

    model: str
    parallel: ParallelConfig
    num_microbatches: int
    micro_batch_size: int
    seq_length: int
    recompute: str
    stages: tuple[StageMemory, ...]
    capacity_bytes: int | None = None
    """Device memory, when a gpu was named."""
    megatron_bytes: float = 0.0
    """Megatron-LM's own estimate (first stage) for comparison."""
    assumptions: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> float:
        """Largest per-rank total over the stages."""
        return max(s.total_bytes for s in self.stages)

    @property
    def peak_stage(self) -> int:
        return max(self.stages, key=lambda s: s.total_bytes).stage

    @property
    def fits(self) -> bool | None:
        """Whether the fullest rank fits the capacity (None when capacity is unknown)."""
        return None if self.capacity_bytes is None else self.peak_bytes <= self.capacity_bytes

    @property
    def world_size(self) -> int:
        return self.parallel.model_parallel_size * (self.parallel.dp or 1)

    def stage_of_rank(self, rank: int) -> int:
        """Pipeline stage of a global rank, Megatron's default order tp-cp-ep-dp-pp."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank // (self.world_size // self.parallel.pp)

    def for_rank(self, rank: int) -> StageMemory:
        return self.stages[self.stage_of_rank(rank)]

    def summary(self) -> Text:
        lines = [
            f"{self.model} | {self.parallel.describe()} | m={self.num_microbatches} "
            f"mbs={self.micro_batch_size} seq={self.seq_length} recompute={self.recompute}"
        ]
        for s in self.stages:
            c = s.components()
            lines.append(
                f"  stage {s.stage}: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in c.items())
                + f" -> {format_bytes(s.total_bytes)}"
            )
        if self.capacity_bytes:
            lines.append(f"  capacity {format_bytes(self.capacity_bytes)}; fits: {self.fits}")
        return Text("\n".join(lines))

    def __str__(self) -> str:
        return self.summary()

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # a cell ending in est.memory(...): the summary
        printer.text(str(self.summary()))


def bytes_per_param(
    train: TrainConfig, dp: int = 1, *, grad_bytes: int | None = None, fsdp: str | None = None
) -> dict[str, float]:
    """Weight / gradient / optimizer bytes per parameter, the sharded ones divided by ``dp``.

    bf16: 2 + 4 + 12 = 18 (6 + 12/dp with the distributed optimizer); fp32:
    4 + 4 + 8 = 16 (8 + 8/dp).  ``fsdp`` (a :attr:`ParallelConfig.fsdp` level) shards more
    (:mod:`mnb.estimate.sharding`): bf16 ``optim`` 2 + 4 + 12/dp, ``optim_grads`` 2 + 16/dp,
    ``optim_grads_params`` 18/dp, where Megatron-FSDP's fp32 main weights (4/dp) count as
    weights, not optimizer state; in fp32 training they are a copy DDP does not have (+4/dp).
    ZeRO-3's gathered layers are not per parameter (:attr:`StageMemory.gathered_weights_bytes`).

        >>> bytes_per_param(TrainConfig(bf16=True), 4, fsdp="optim_grads")
        {'weights': 3.0, 'gradients': 1.0, 'optimizer': 2.0}
    """
    shard = sharded_components(ParallelConfig(fsdp=fsdp), train)
    full = unsharded_bytes_per_param(train, grad_bytes)
    out = {k: v / dp if k in shard else v for k, v in full.items()}
    if fsdp:  # Megatron-FSDP keeps the fp32 main weights in its own (sharded) weight buffer
        out["weights"] += MAIN_WEIGHT_BYTES / dp
        out["optimizer"] = ADAM_STATE_BYTES / dp
    return out


def _linear_params_per_layer(model: ModelConfig, tp: int) -> float:
    """Weights of one layer's parallel linears on a tp rank: what FP8 linears (``model.fp8``) hold a 1-byte copy of
    in each of two layouts (forward, transposed for the input gradient) during a step (:mod:`mnb.megatron.fp8`)."""
    h = model.hidden_size
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    mlp = model.ffn * h * (3 if model.gated_linear_unit else 2)
    return (h * (q + 2 * kv) + q * h + mlp) / tp


def memory(
    model: str | ModelConfig | dict,
    parallel: ParallelConfig | dict | None = None,
    train: TrainConfig | dict | None = None,
    *,
    gpus: int | None = None,
    num_microbatches: int | None = None,
    gpu: str | None = None,
    fused_attention: bool = True,
    fused_loss: bool = False,
    fused_kernels: bool = True,
    cpu_kernels: bool = False,
    grad_bytes: int | None = None,
    overhead_fraction: float = 0.05,
    lora: LoraConfig | dict | None = None,
) -> MemoryEstimate:
    """Predict memory per rank and pipeline stage, by component, in bytes.

    ``model``: ModelConfig, preset name, Hugging Face checkpoint folder or field dict (its ``seq_length`` is
    the training sequence length).  ``parallel``: ParallelConfig with dp set,
    or pass ``gpus`` (the world size) to resolve dp.  ``train``: TrainConfig
    (micro batch, global batch -> microbatches, bf16, recompute, distributed
    optimizer).  ``gpu`` names a hardware-table entry for ``capacity_bytes``.
    ``fused_attention``: flash/SDPA attention (no s*s scores kept).
    ``fused_loss``: the loss keeps only the logits (mnb's fused cross entropy,
    on by default on CUDA ranks) instead of Megatron's fp32 softmax beside them.
    ``fused_kernels``: mnb's compiled SwiGLU and RoPE (False: Megatron's own ops keep more).
    ``cpu_kernels``: the ranks run on CPU (torch's CPU norms keep more; see activations.py).
    ``grad_bytes``: gradient bytes per param (default 4: fp32 main grads).
    ``lora``: LoRA adapters (:class:`mnb.config.LoraConfig` or its fields, as :func:`mnb.lora` takes
    them): the base weights are frozen (their weights only, no gradients or Adam state); the
    adapters hold weights, gradients and optimizer state.

    Example::

        mnb.estimate.memory("llama-7b", ParallelConfig(tp=2), TrainConfig(bf16=True), gpus=8)
    """
    model = as_model(model)
    train = as_train(train)
    parallel = as_parallel(parallel, gpus)
    model.check_parallel(parallel)
    if overhead_fraction < 0:
        raise ValueError(f"overhead_fraction must be >= 0, got {overhead_fraction}")
    m = resolve_microbatches(train, parallel, num_microbatches)
    pp, tp, cp, ep, dp = parallel.pp, parallel.tp, parallel.cp, parallel.ep, parallel.dp or 1
    problem = interleave_problem(m, pp, parallel.vpp, train.micro_batch_size * dp)
    if problem:
        raise ValueError(problem)
    sp = parallel.sequence_parallel and tp > 1
    e = 2 if (train.bf16 or train.fp8) else 4
    s_local = model.seq_length // cp
    b = train.micro_batch_size
    h = model.hidden_size
    shape = LayerShape(
        seq=s_local, micro_batch=b, tp=tp, sequence_parallel=sp, element_bytes=e,
        recompute=train.recompute, fused_attention=fused_attention,
        fused_kernels=fused_kernels, cpu_kernels=cpu_kernels, cp=cp,
    )
    per_layer = layer_activation_bytes(model, shape)
    one_full_layer = full_layer_bytes(model, shape)
    vocab = padded_vocab_size(model, tp)
    v = parallel.vpp
    sp_div = tp if sp else 1
    dense_bpp = bytes_per_param(train, dp * cp, grad_bytes=grad_bytes, fsdp=parallel.fsdp)
    expert_bpp = bytes_per_param(train, max(dp * cp // ep, 1), grad_bytes=grad_bytes, fsdp=parallel.fsdp)
    full_weight = unsharded_bytes_per_param(train)["weights"]
    lora = lora_config(lora)
    adapter_per_layer = lora_layer_params(model, lora, tp) if lora is not None else 0
    # frozen weights (LoRA): the weights alone, sharded only by ZeRO-3
    frozen_bpp = full_weight / (dp * cp) if parallel.fsdp == "optim_grads_params" else full_weight

    stages = []
    for stage in range(pp):
        params = stage_params(model, parallel, stage)
        chunks = in_flight(pp, stage, m, parallel.vpp)
        layers_per_chunk = params.num_layers / v
        acts = chunks * layers_per_chunk * per_layer
        recomputed = one_full_layer if train.recompute == "full" else 0.0  # rematerialised in backward
        acts += recomputed
        mbs_in_flight = min(chunks, m)
        if stage == 0:
            acts += mbs_in_flight * s_local * b * 8 * 2  # int64 token and position ids
            if dropout(model, "hidden_dropout") > 0:
                acts += mbs_in_flight * s_local * b * h / sp_div  # embedding dropout mask
        # ZeRO-3: the layers being computed and prefetched, and the parameters outside the units, gathered
        gathered = gathered_params(model, parallel, stage) * full_weight if dp * cp > 1 else 0.0
        fp8_copies = 2 * params.num_layers * _linear_params_per_layer(model, tp) if model.fp8 else 0.0
        logits = 0.0
        if stage == pp - 1:
            acts += 2 * s_local * b * h * e / sp_div + norm_extra_bytes(shape, h)  # final norm, output layer input
            # Megatron's vocab-parallel cross entropy keeps an fp32 softmax beside the logits
            # (the same buffer when training in fp32; in backward the softmax becomes the
            # gradient in place, cast to a logits-sized copy).  mnb's fused one keeps the
            # logits only, and its backward writes their gradient beside them.
            logits = s_local * b * vocab / tp * (2 * e if fused_loss else 4 + (e if e != 4 else 0))
        if lora is None:
            weights = params.dense * dense_bpp["weights"] + params.expert * expert_bpp["weights"]
            gradients = params.dense * dense_bpp["gradients"] + params.expert * expert_bpp["gradients"]
            optimizer = params.dense * dense_bpp["optimizer"] + params.expert * expert_bpp["optimizer"]
        else:  # every base weight frozen; the adapters train
            adapters = params.num_layers * adapter_per_layer
            weights = params.total * frozen_bpp + adapters * dense_bpp["weights"]
            gradients, optimizer = adapters * dense_bpp["gradients"], adapters * dense_bpp["optimizer"]
        stages.append(
            StageMemory(
                stage=stage,
                num_layers=params.num_layers,
                params=params.total + (params.num_layers * adapter_per_layer),
                in_flight_microbatches=chunks,
                weights_bytes=weights + gathered + fp8_copies,
                gathered_weights_bytes=gathered,
                gradients_bytes=gradients,
                optimizer_bytes=optimizer,
                activations_bytes=acts,
                recomputed_bytes=recomputed,
                logits_bytes=logits,
                other_bytes=overhead_fraction * (acts + logits),
            )
        )
    # CPU ranks share the host's RAM: the world (at most a node's 8) divides it
    world = parallel.model_parallel_size * (parallel.dp or 1)
    capacity = hardware.rank_capacity_bytes(hardware.device(gpu), min(8, world)) if gpu else None
    return MemoryEstimate(
        model=model.name,
        parallel=parallel,
        num_microbatches=m,
        micro_batch_size=b,
        seq_length=model.seq_length,
        recompute=train.recompute,
        stages=tuple(stages),
        capacity_bytes=capacity,
        megatron_bytes=megatron_estimate_bytes(model, parallel, train, m),
        assumptions={
            "fused_attention": fused_attention,
            "fused_loss": fused_loss,
            "fused_kernels": fused_kernels,
            "cpu_kernels": cpu_kernels,
            "hidden_dropout": dropout(model, "hidden_dropout"),
            "attention_dropout": dropout(model, "attention_dropout"),
            "padded_vocab_size": vocab,
            "bytes_per_param": dense_bpp,
            "sharding": level_name(parallel, train),
            "overhead_fraction": overhead_fraction,
            "lora": lora,
            "lora_params_per_layer": adapter_per_layer,
        },
    )


def megatron_estimate_bytes(
    model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, num_microbatches: int
) -> float:
    """Megatron-LM's theoretical_memory_usage estimate (first stage), for comparison.

    Weights+optimizer: (layers/pp + embedding) / tp params at 18 B (6 + 12/dp
    with the distributed optimizer); activations (SP + selective formula):
    s*b*h*(18 + 4*ffn/h) per layer * layers, embedding extras for pp
    microbatches, the interleaving factor or min(1, m/pp), logits for pp == 1,
    all / tp.
    """
    h, s, b = model.hidden_size, model.seq_length, train.micro_batch_size
    pp, tp, dp = parallel.pp, parallel.tp, parallel.dp or 1
    vocab = padded_vocab_size(model, tp)
    norm = 1 if model.normalization == "RMSNorm" else 2
    q = model.num_attention_heads * model.head_dim
    gate = 1.5 if model.gated_linear_unit else 1.0
    experts = model.num_moe_experts or 1
    ffn = model.moe_ffn if model.is_moe else model.ffn
    layer = 2 * h * (ffn * experts * gate + norm) + 2 * h * h * (1 + model.query_groups / model.num_attention_heads) * q / h
    block = layer * model.num_layers + norm * h
    shard = (block / pp + vocab * h) / tp
    if not model.share_embeddings_and_output_weights and pp == 1:
        shard += vocab * h / tp
    bpp = 6 + 12 / dp if train.use_distributed_optimizer else 18
    acts = s * b * h * (18 + 4 * model.ffn / h) * model.num_layers
    acts += 8 * s * b * pp + s * b * h * pp
    if parallel.vpp > 1:  # Megatron-LM: virtual_pipeline_model_parallel_size is not None
        acts *= 1 + (pp - 1) / (pp * parallel.vpp)
    elif pp > 1:
        acts *= min(1, num_microbatches / pp)
    if pp == 1:
        acts += s * b * h * 4 * (1 + vocab / h)
    return shard * bpp + acts / tp
