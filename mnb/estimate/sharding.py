"""Data-parallel sharding: what each rank keeps of weights, gradients and optimizer state, and what moves.

The levels are ZeRO's (Rajbhandari et al. 2020) as Megatron spells them
(``ParallelConfig.fsdp``, Megatron-FSDP's ``data_parallel_sharding_strategy``);
``n`` is the sharding group, dp * cp (Megatron shards over both; experts over
dp * cp / ep), and w, g, o are the bytes per parameter of the weights, the
gradients and the optimizer state (bf16: 2, 4, 12; fp32: 4, 4, 8; see
:func:`mnb.estimate.memory.bytes_per_param`):

============================  ==================  ================================================
level                         bytes per param      collectives per step (buffer bytes, P params)
============================  ==================  ================================================
DDP                           w + g + o            all-reduce P*g
distributed optimizer         w + g + o/n          reduce-scatter P*g, all-gather P*w
fsdp ``optim`` (ZeRO-1)       w + g + o'/n         reduce-scatter P*g, all-gather P*w
fsdp ``optim_grads`` (ZeRO-2) w + (g + o')/n       reduce-scatter m*P*g, all-gather P*w
fsdp ``optim_grads_params``   (w + g + o')/n       reduce-scatter m*P*g, all-gather (2*m*P_L + P_E)*w
(ZeRO-3)                      + gathered layers
============================  ==================  ================================================

o' = 4 + 8: Megatron-FSDP keeps fp32 main weights (sharded, counted with the weights) and
Adam's m and v; in bf16 that is the distributed optimizer's 12, in fp32 training 4 more than
its 8 (the main weights are a copy of their own there).

With sharded gradients Megatron-FSDP reduce-scatters in every microbatch's
backward (``grad_reduce_every_bprop`` in megatron_fsdp.py: no full gradient
is kept to accumulate into), so m microbatches move m times the gradients;
without, once, after the last microbatch.  ZeRO-3 gathers each FSDP unit (a
``TransformerLayer``, Megatron's default units) before its forward and frees it after; what a
rank holds gathered beside its shards is set by Megatron-FSDP's prefetch (:func:`gathered_layers`):
at the start of backward, where the activations peak, most often every layer.  The parameters
outside any unit (P_E: embedding, output layer, final norm) are gathered once per step and stay
gathered.  Counted on CPU ranks: 2*m*layers + 1 all-gathers per step (2 microbatches of tiny: 16
of a layer's bucket and 1 of the rest): the optimizer step gathers everything, each forward
gathers the layers (they are released after their forward) and the final norm's pre-forward
gathers them again for the backward.  The optimizer step updates the shards in place; the lower
levels all-gather the updated parameters once per step.

Buffer bytes are the full (gathered) size each collective covers; a ring over
n ranks sends (n-1)/n of it per rank for a reduce-scatter or all-gather and
2(n-1)/n for an all-reduce (Patarasuk & Yuan 2009): :meth:`DataParallelTraffic.sent_bytes`.

    >>> from mnb.config import ParallelConfig, TrainConfig
    >>> t = dp_traffic("tiny", ParallelConfig(dp=2, fsdp="optim_grads_params"),
    ...                TrainConfig(global_batch_size=4))
    >>> t.level, t.group_size, t.num_microbatches
    ('optim_grads_params', 2, 2)
    >>> outside = 2 * 512 * 64 + 64   # embedding, output layer, final norm: gathered once
    >>> t.all_gather_bytes == (2 * 2 * (t.params - outside) + outside) * 4   # fp32 weights
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from mnb.config import FSDP_STRATEGIES, ModelConfig, ParallelConfig, TrainConfig

from ._inputs import as_model, as_parallel, as_train
from ._inputs import num_microbatches as resolve_microbatches
from .params import layer_params, stage_params

MAIN_WEIGHT_BYTES = 4
"""Megatron-FSDP's main weights: fp32 (``megatron_fsdp_main_params_dtype``'s default), sharded, in its
weight buffer beside the model's compute weights -- also when training in fp32."""
ADAM_STATE_BYTES = 8
"""Adam's m and v in fp32: the optimizer state proper once the main weights live in FSDP's buffer."""

AG_PREFETCH_FLOOR = 1_000_000_000
"""Megatron-FSDP's ``suggested_communication_unit_size`` when the config leaves it None (mnb does): twice
the mean unit's elements, raised to at least this (``max(1_000_000_000, ...)`` under the comment "Cap to
1B elements", megatron_fsdp.py in 0.16.1 and 0.19.2).  Half of it is the all-gather prefetch budget."""


def unsharded_bytes_per_param(train: TrainConfig, grad_bytes: int | None = None) -> dict[str, int]:
    """Weight / gradient / optimizer bytes per parameter before sharding: bf16 2, 4, 12; fp32 4, 4, 8.

    ``grad_bytes`` replaces the gradients' 4 (fp32 main gradients, Megatron's default for bf16).
    """
    weight, grad, optim = (2, 4, 12) if (train.bf16 or train.fp8) else (4, 4, 8)
    return {"weights": weight, "gradients": grad if grad_bytes is None else grad_bytes, "optimizer": optim}


def sharded_components(parallel: ParallelConfig, train: TrainConfig) -> tuple[str, ...]:
    """The components divided over the sharding group: what the level shards.

        >>> sharded_components(ParallelConfig(fsdp="optim_grads"), TrainConfig())
        ('optimizer', 'gradients')
        >>> sharded_components(ParallelConfig(), TrainConfig(use_distributed_optimizer=True))
        ('optimizer',)
    """
    level = parallel.fsdp
    if level is None:
        return ("optimizer",) if train.use_distributed_optimizer else ()
    return ("optimizer", "gradients", "weights")[: FSDP_STRATEGIES.index(level) + 1]  # ZeRO order: 1, 2, 3


def level_name(parallel: ParallelConfig, train: TrainConfig) -> str:
    """'ddp', 'distributed optimizer' or the fsdp level."""
    if parallel.fsdp:
        return parallel.fsdp
    return "distributed optimizer" if train.use_distributed_optimizer else "ddp"


def gathered_layers(model: ModelConfig, parallel: ParallelConfig, stage: int = 0) -> int:
    """Transformer layers a ZeRO-3 rank holds gathered at the start of backward (0 below ZeRO-3).

    Megatron-FSDP's prefetch (``AllGatherPipeline.all_gather_params``): a gather also fetches the
    next buckets, in forward or backward order, while what it added is below the budget
    ``suggested_AG_prefetch_size`` = ``max(`` :data:`AG_PREFETCH_FLOOR` ``, 2 * unit) // 2`` elements
    (``unit``: a layer's parameters on this rank), so ``k = ceil(budget / unit)`` layers beyond the
    one asked for.  Each unit is released after its forward (``_post_forward``), but the final
    norm and the output layer are outside the units: their pre-forward gathers the first bucket
    (the parameters outside the units) and prefetches from layer 1 on, so layers 1..k stay
    gathered until their own backward.  The last layer's pre-backward gathers it and prefetches
    the k before it.  At that moment every microbatch activation is still held: 2k + 1 layers, at
    most the stage's (every layer of a model whose layers are below 500M parameters per rank;
    llama-8b on one tp rank: k = 3, 7 layers).  Measured on CPU ranks (tests/megatron/test_memory.py).
    """
    if parallel.fsdp != "optim_grads_params":
        return 0
    layers = stage_params(model, parallel, stage).num_layers
    unit = sum(layer_params(model, parallel.tp, parallel.ep))
    if layers == 0 or unit == 0:
        return 0
    budget = max(AG_PREFETCH_FLOOR, 2 * unit) // 2
    ahead = -(-budget // unit)
    return min(layers, 2 * ahead + 1)


def gathered_params(model: ModelConfig, parallel: ParallelConfig, stage: int = 0) -> int:
    """Parameters a ZeRO-3 rank of ``stage`` holds gathered beside its shards (0 below ZeRO-3).

    :func:`gathered_layers` transformer layers plus the parameters outside the FSDP units
    (embedding, output layer, final norm on this stage).
    """
    if parallel.fsdp != "optim_grads_params":
        return 0
    params = stage_params(model, parallel, stage)
    dense, expert = layer_params(model, parallel.tp, parallel.ep)
    return gathered_layers(model, parallel, stage) * (dense + expert) + params.embedding


@dataclass(frozen=True, kw_only=True)
class DataParallelTraffic:
    """The data-parallel collectives of one training step on one rank of the fullest stage."""

    level: str
    """'ddp', 'distributed optimizer', 'optim', 'optim_grads' or 'optim_grads_params'."""
    group_size: int
    """Ranks the collectives span (dp * cp)."""
    params: int
    """Parameters of this rank's model replica slice (the fullest pipeline stage)."""
    num_microbatches: int
    all_reduce_bytes: float
    """Full buffer bytes all-reduced per step (gradients, plain DDP)."""
    reduce_scatter_bytes: float
    """Full buffer bytes reduce-scattered per step (gradients)."""
    all_gather_bytes: float
    """Full buffer bytes all-gathered per step (parameters)."""
    calls: dict[str, int]
    """Collective calls per step by kind, counting each bucket/unit set once (per microbatch where it repeats)."""

    def sent_bytes(self, kind: str | None = None) -> float:
        """Bytes one rank sends per step in a ring, for ``kind`` ('all_reduce', 'reduce_scatter',
        'all_gather') or all of them."""
        n = self.group_size
        if n <= 1:
            return 0.0
        share = {"all_reduce": 2 * (n - 1) / n * self.all_reduce_bytes,
                 "reduce_scatter": (n - 1) / n * self.reduce_scatter_bytes,
                 "all_gather": (n - 1) / n * self.all_gather_bytes}
        if kind is None:
            return sum(share.values())
        if kind not in share:
            raise ValueError(f"kind must be one of {', '.join(share)} or None, got {kind!r}")
        return share[kind]

    def as_dict(self) -> dict[str, float]:
        """Buffer bytes per collective kind (the ones this level uses)."""
        out = {"all_reduce": self.all_reduce_bytes, "reduce_scatter": self.reduce_scatter_bytes,
               "all_gather": self.all_gather_bytes}
        return {k: v for k, v in out.items() if v}


def dp_traffic(
    model: str | ModelConfig | dict,
    parallel: ParallelConfig | dict | None = None,
    train: TrainConfig | dict | None = None,
    *,
    gpus: int | None = None,
    num_microbatches: int | None = None,
    grad_bytes: int | None = None,
) -> DataParallelTraffic:
    """The data-parallel all-reduce / reduce-scatter / all-gather volumes of one step (see the module).

        mnb.estimate.dp_traffic("llama-8b", ParallelConfig(fsdp="optim_grads_params"),
                                TrainConfig(bf16=True, global_batch_size=64), gpus=8).sent_bytes()

    Bytes per element: :func:`unsharded_bytes_per_param` (``grad_bytes`` as in :func:`mnb.estimate.memory`).
    With one rank in the group nothing moves: every volume is 0.
    """
    model = as_model(model)
    train = as_train(train)
    parallel = as_parallel(parallel, gpus)
    model.check_parallel(parallel)
    m = resolve_microbatches(train, parallel, num_microbatches)
    n = (parallel.dp or 1) * parallel.cp
    bpp = unsharded_bytes_per_param(train, grad_bytes)
    p = max(stage_params(model, parallel, r).total for r in range(parallel.pp))
    level = level_name(parallel, train)
    ar = rs = ag = 0.0
    calls = {}
    if n > 1:
        grads, weights = p * bpp["gradients"], p * bpp["weights"]
        if level == "ddp":
            ar, calls = grads, {"all_reduce": 1}
        elif level in ("distributed optimizer", "optim"):
            rs, ag, calls = grads, weights, {"reduce_scatter": 1, "all_gather": 1}
        elif level == "optim_grads":
            rs, ag, calls = m * grads, weights, {"reduce_scatter": m, "all_gather": 1}
        else:  # each layer before its forward and its backward; the rest (embedding, output layer) once
            outside = max(stage_params(model, parallel, r).embedding for r in range(parallel.pp))
            ag = (2 * m * (p - outside) + outside) * bpp["weights"]
            rs, calls = m * grads, {"reduce_scatter": m, "all_gather": 2 * m + 1}
    return DataParallelTraffic(
        level=level, group_size=n, params=p, num_microbatches=m,
        all_reduce_bytes=ar, reduce_scatter_bytes=rs, all_gather_bytes=ag, calls=calls,
    )
