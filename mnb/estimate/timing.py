"""Step time of a Megatron layout: where one training step's time goes, per GPU.

Two models behind one function, :func:`step_time`:

**The shape-aware model** (the default).  Each pipeline stage's time for one
microbatch is the sum of its kernels (:mod:`mnb.estimate.kernels`: every GEMM
at the device's efficiency for its shape, core attention at its own
efficiency, elementwise and norm kernels from memory bandwidth, recompute,
gradient accumulation) plus the communication Megatron does not hide:

- tp: per layer 2 all-reduces forward and 2 backward (reduce-scatter +
  all-gather pairs with sequence parallelism: the same bytes), 2 more with full
  recompute; exposed unless ``tp_comm_overlap`` (then only what exceeds the
  layer's GEMM time);
- cp: 3 passes of K and V per layer (forward, and K/V again with their gradients backward);
  Megatron's ``cp_comm_type``: ``"all_gather"`` (mnb's own context parallelism without TE, and
  Llama 3's) exposes them, ``"p2p"`` (TE's ring, Megatron-LM's default) sends each pass while
  the attention block before it computes, so only what exceeds the layer's core attention shows;
  ep: 4 all-to-alls per MoE layer;
- pp: one activation forward and one gradient backward per microbatch and
  virtual chunk;
- dp (per step): the gradient all-reduce, or reduce-scatter + parameter
  all-gather with the distributed optimizer; Megatron-FSDP's levels
  (``ParallelConfig.fsdp``) reduce-scatter every microbatch once gradients are
  sharded and ZeRO-3 gathers the parameters before each forward and backward
  (volumes: :func:`mnb.estimate.sharding.dp_traffic`).  ``overlap_grad_reduce`` hides the
  reduce behind the last microbatch's backward, ``overlap_param_gather`` the
  gather behind the first microbatch's forward (Megatron's
  DistributedDataParallelConfig flags of those names); the rest is exposed.

The stages combine as the 1F1B schedule runs them: with per-microbatch stage
times T_i, a step takes ``m * max(T) + (sum(T) - max(T)) / vpp`` (the
interleaved schedule divides the fill and drain by vpp; Narayanan et al. 2021,
sec. 2.2), so the slowest stage (the last one with the logits and the loss,
or a stage with more layers) sets the pace and the others' share is the
bubble.  The Adam step adds its memory traffic.  MFU counts model FLOPs, HFU
(hardware FLOPs utilisation) adds recomputation; both are reported.

**The first-order model** (``achievable_fraction=`` given): compute at that fixed
fraction of peak, ``(pp-1)/(vpp*m)`` bubble, nothing overlapped; kept for
comparisons with earlier numbers.

A ring collective over n ranks moves 2(n-1)/n of the buffer per rank for an
all-reduce and (n-1)/n for reduce-scatter / all-gather / all-to-all (Patarasuk
& Yuan 2009).  Groups that fit in a node use NVLink bandwidth, others the
per-GPU network bandwidth, each at the device's collective efficiency; ranks
are ordered tp-cp-ep-dp-pp as Megatron does.  Latency is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from mnb.config import ModelConfig, ParallelConfig, TrainConfig

from . import hardware
from ._inputs import as_model, as_parallel, as_train
from ._inputs import num_microbatches as resolve_microbatches
from .explain import Explanation
from .flops import flops, hardware_flops
from .kernels import StageWork, fuses_weight_gradients, stage_work
from .memory import bytes_per_param
from .sharding import dp_traffic, sharded_components
from .pipeline import bubble_time_ratio


CP_COMM_TYPES = ("all_gather", "p2p")
"""Megatron's ``cp_comm_type`` values the step-time model knows."""


@dataclass(frozen=True, kw_only=True)
class StepTimeEstimate:
    """Predicted time of one training step, by part, in seconds (see :meth:`explain`)."""

    compute_s: float
    """All kernels of the busiest stage over the step's microbatches (the ``compute_parts``)."""
    bubble_s: float
    """Time the busiest stage waits for the others (pipeline fill and drain)."""
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    """Exposed gradient reduce (and parameter gather) of the data-parallel replicas."""
    model_flops: float
    """Model FLOPs per step (no recompute)."""
    tokens_per_step: int
    num_gpus: int
    peak_flops: float
    """Per-device peak used."""
    hardware_flops: float = 0.0
    """FLOPs executed per step: model FLOPs plus recomputation (same attention convention)."""
    optimizer_s: float = 0.0
    """The optimizer step (memory traffic of Adam over this rank's shard)."""
    compute_parts: tuple[tuple[str, float], ...] = ()
    """``compute_s`` by kind: gemm, attention, elementwise/norms, recompute, grad accumulation."""
    hidden_comm: tuple[tuple[str, float], ...] = ()
    """Communication overlapped with compute (not in the total), by collective."""
    model: str = "first-order"
    """'shape-aware' or 'first-order' (a fixed achievable_fraction)."""

    @property
    def total_s(self) -> float:
        return (
            self.compute_s + self.bubble_s + self.tp_comm_s + self.cp_comm_s
            + self.ep_comm_s + self.pp_comm_s + self.dp_comm_s + self.optimizer_s
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs / (step time * GPUs * peak)."""
        return self.model_flops / (self.total_s * self.num_gpus * self.peak_flops)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: executed FLOPs (with recompute) / (step time * GPUs * peak)."""
        return (self.hardware_flops or self.model_flops) / (self.total_s * self.num_gpus * self.peak_flops)

    @property
    def tflops_per_gpu(self) -> float:
        """Hardware TFLOP/s per GPU, the figure Megatron-LM papers report."""
        return (self.hardware_flops or self.model_flops) / self.total_s / self.num_gpus / 1e12

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # a cell ending in est.step_time(...): the table
        printer.text(str(self.explain().table()))

    def explain(self) -> Explanation:
        """Where the predicted time goes, one row per part (compute by kind, bubble, each collective)."""
        rows = list(self.compute_parts) or [("compute", self.compute_s)]
        rows += [("pipeline bubble", self.bubble_s), ("optimizer step", self.optimizer_s),
                 ("tp communication (exposed)", self.tp_comm_s), ("cp communication", self.cp_comm_s),
                 ("ep all-to-all", self.ep_comm_s), ("pp send/recv", self.pp_comm_s),
                 ("dp collectives (exposed)", self.dp_comm_s)]
        return Explanation(
            rows=tuple((name, s) for name, s in rows if s > 0 or name in ("pipeline bubble",)),
            hidden=tuple((n, s) for n, s in self.hidden_comm if s > 0),
            total_s=self.total_s, mfu=self.mfu, hfu=self.hfu, tflops_per_gpu=self.tflops_per_gpu,
            model=self.model,
        )


def _bandwidth(dev: hardware.Device, stride: int, size: int, gpus_per_node: int) -> float:
    if stride * size <= gpus_per_node:
        return dev.intra_node_bytes_per_s * dev.intra_efficiency
    return dev.inter_node_bytes_per_s * dev.inter_efficiency


def step_time(
    model: str | ModelConfig | dict,
    parallel: ParallelConfig | dict | None = None,
    train: TrainConfig | dict | None = None,
    *,
    gpus: int | None = None,
    gpu: str = "h200",
    peak_flops: float | None = None,
    achievable_fraction: float | None = None,
    gpus_per_node: int = 8,
    num_microbatches: int | None = None,
    causal: bool = False,
    attention: str = "flash",
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    tp_comm_overlap: bool = False,
    gradient_accumulation_fusion: bool | None = None,
    grad_bytes: int | None = None,
    cp_comm_type: str = "all_gather",
) -> StepTimeEstimate:
    """Estimate the time of one step; see the module docstring for the model.

        est = mnb.estimate.step_time("llama-7b", ParallelConfig(), TrainConfig(
            bf16=True, global_batch_size=128), gpus=8, gpu="h200")
        est.explain()          # where the time goes, one table

    ``gpu``: a :mod:`mnb.estimate.hardware` table key (or :func:`~mnb.estimate.hardware.register` your
    own); ``peak_flops`` replaces its peak (the GEMM curve's fractions then apply to it).
    ``attention``: 'flash' (flash/SDPA kernels: mnb's and TE's) or 'unfused' (Megatron's local
    DotProductAttention: full s x s scores).  ``causal`` is the model-FLOPs convention of MFU
    (:func:`mnb.estimate.flops`); executed attention work follows ``attention``.
    ``overlap_grad_reduce``, ``overlap_param_gather``, ``tp_comm_overlap``,
    ``gradient_accumulation_fusion``: Megatron's settings of those names (mnb's own training
    runs with the first three off; ``gradient_accumulation_fusion=None``, the default, is what mnb's
    training does: on for GPUs but for local-spec FP8 linears and Megatron-FSDP,
    :func:`~mnb.estimate.kernels.fuses_weight_gradients`).  ``grad_bytes``: bytes per gradient element as reduced and
    accumulated (default 4: Megatron's ``grad_reduce_in_fp32``, mnb's setting; 2 for bf16/fp16
    gradients), as in :func:`mnb.estimate.memory`.  ``cp_comm_type``: ``"all_gather"`` (K/V
    gathered, not overlapped: mnb's context parallelism without TE) or ``"p2p"`` (TE's ring,
    overlapped with the attention blocks; Megatron-LM's default).  ``achievable_fraction``
    switches to the first-order model.
    """
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {', '.join(CP_COMM_TYPES)} (Megatron's names; a2a is not "
                         f"modelled), got {cp_comm_type!r}")
    model = as_model(model)
    train = as_train(train)
    parallel = as_parallel(parallel, gpus)
    model.check_parallel(parallel)
    m = resolve_microbatches(train, parallel, num_microbatches)
    if achievable_fraction is not None:
        return _first_order(model, parallel, train, m, gpu, peak_flops, achievable_fraction, gpus_per_node, causal)
    dev = hardware.device(gpu)
    dtype = hardware.train_dtype(train.bf16, train.fp8)
    peak = peak_flops or hardware.peak_flops(gpu, dtype)
    pp, tp, cp, ep, dp = parallel.pp, parallel.tp, parallel.cp, parallel.ep, parallel.dp or 1
    world = parallel.model_parallel_size * dp
    gbs = m * train.micro_batch_size * dp
    e = 2 if (train.bf16 or train.fp8) else 4
    v = parallel.vpp

    if gradient_accumulation_fusion is None:
        gradient_accumulation_fusion = fuses_weight_gradients(dev, model, parallel)
    bpp = bytes_per_param(train, grad_bytes=grad_bytes)
    layers = model.layers_per_stage(pp)
    distinct: dict[tuple[int, bool, bool], StageWork] = {}  # middle stages of equal size are alike
    works = []
    for r in range(pp):
        key = (layers[r], r == 0, r == pp - 1)
        if key not in distinct:
            distinct[key] = stage_work(model, parallel, train, dev, peak, r, attention=attention,
                                       grad_bytes=bpp["gradients"],
                                       gradient_accumulation_fusion=gradient_accumulation_fusion)
        works.append(distinct[key])
    s, b, h = model.seq_length // cp, train.micro_batch_size, model.hidden_size
    act = s * b * h * e
    comm = []  # per stage and microbatch: (tp exposed, tp hidden, cp, ep)
    for r, w in enumerate(works):
        tp_s = cp_s = ep_s = 0.0
        if tp > 1:
            per_layer = 4 + (2 if train.recompute == "full" else 0)
            tp_s = layers[r] * per_layer * 2 * (tp - 1) / tp * act / _bandwidth(dev, 1, tp, gpus_per_node)
        if cp > 1:
            kv = model.query_groups * model.head_dim
            nbytes = layers[r] * 3 * (cp - 1) * s * b * 2 * kv * e / tp
            cp_s = nbytes / _bandwidth(dev, tp, cp, gpus_per_node)
        if ep > 1 and model.is_moe:
            nbytes = layers[r] * 4 * (ep - 1) / ep * act * model.moe_router_topk / tp
            ep_s = nbytes / _bandwidth(dev, tp * cp, ep, gpus_per_node)
        hidden = cp_hidden = 0.0
        if tp_comm_overlap and tp_s:
            exposed = max(0.0, tp_s - layers[r] * w.gemm_per_layer_s)
            hidden, tp_s = tp_s - exposed, exposed
        if cp_comm_type == "p2p" and cp_s:  # each ring pass hides behind the attention block it precedes
            exposed = max(0.0, cp_s - w.attention_s)
            cp_hidden, cp_s = cp_s - exposed, exposed
        comm.append((tp_s, hidden, cp_s, ep_s, cp_hidden))
    per_mb = [w.total_s + c[0] + c[2] + c[3] for w, c in zip(works, comm)]
    slow = max(range(pp), key=lambda r: per_mb[r])
    w, (tp_s, tp_hidden, cp_s, ep_s, cp_hidden) = works[slow], comm[slow]
    bubble_s = (sum(per_mb) - per_mb[slow]) / v

    pp_s = 0.0
    if pp > 1:
        nbytes = 2 * m * v * act / (tp if parallel.sequence_parallel else 1)
        pp_s = nbytes / _bandwidth(dev, tp * cp * dp, pp, gpus_per_node)
    dp_s = dp_hidden = 0.0
    traffic = dp_traffic(model, parallel, train, num_microbatches=m, grad_bytes=grad_bytes)
    params = traffic.params
    n = dp * cp
    if n > 1:
        bw = _bandwidth(dev, tp, n, gpus_per_node)
        reduce_s = (traffic.sent_bytes("reduce_scatter") + traffic.sent_bytes("all_reduce")) / bw
        gather_s = traffic.sent_bytes("all_gather") / bw
        # what each collective can hide behind: the backward of the microbatches it follows (the
        # last one, or every one when fsdp reduces per microbatch), the forward(s) a gather precedes
        reduce_calls = traffic.calls.get("reduce_scatter", traffic.calls.get("all_reduce", 0))
        if parallel.fsdp == "optim_grads_params":
            gather_window = m * (w.forward_s + w.backward_s)
        else:
            gather_window = w.forward_s
        exposed_reduce = max(0.0, reduce_s - reduce_calls * w.backward_s) if overlap_grad_reduce else reduce_s
        exposed_gather = max(0.0, gather_s - gather_window) if overlap_param_gather else gather_s
        dp_s = exposed_reduce + exposed_gather
        dp_hidden = reduce_s + gather_s - dp_s
    shard = n if "optimizer" in sharded_components(parallel, train) else 1
    optimizer_s = params / shard * (30 if e == 2 else 28) / (dev.hbm_bytes_per_s * dev.memory_efficiency)

    parts = (("GEMM", m * w.gemm_s), ("core attention", m * w.attention_s),
             ("elementwise and norms", m * w.memory_s), ("recompute", m * w.recompute_s),
             ("gradient accumulation", m * w.grad_accumulation_s))
    model_f = flops(model, train, global_batch_size=gbs, causal=causal)
    hw_f = hardware_flops(model, train, global_batch_size=gbs, causal=causal)
    return StepTimeEstimate(
        compute_s=sum(t for _, t in parts),
        bubble_s=bubble_s,
        tp_comm_s=m * tp_s,
        cp_comm_s=m * cp_s,
        ep_comm_s=m * ep_s,
        pp_comm_s=pp_s,
        dp_comm_s=dp_s,
        model_flops=model_f,
        hardware_flops=hw_f,
        tokens_per_step=gbs * model.seq_length,
        num_gpus=world,
        peak_flops=peak,
        optimizer_s=optimizer_s,
        compute_parts=tuple((k, t) for k, t in parts if t > 0),
        hidden_comm=(("tp (tp_comm_overlap)", m * tp_hidden), ("cp (cp_comm_type p2p)", m * cp_hidden),
                     ("dp (overlap_grad_reduce / overlap_param_gather)", dp_hidden)),
        model="shape-aware",
    )


def _first_order(model, parallel, train, m, gpu, peak_flops, achievable_fraction, gpus_per_node, causal):
    """Fixed achievable fraction of peak, (pp-1)/(vpp*m) bubble, nothing overlapped (the earlier model)."""
    if not 0 < achievable_fraction <= 1:
        raise ValueError(f"achievable_fraction must be in (0, 1], got {achievable_fraction}")
    pp, tp, cp, ep, dp = parallel.pp, parallel.tp, parallel.cp, parallel.ep, parallel.dp or 1
    world = parallel.model_parallel_size * dp
    gbs = m * train.micro_batch_size * dp
    dev = hardware.device(gpu)
    dtype = hardware.train_dtype(train.bf16, train.fp8)
    peak = peak_flops or hardware.peak_flops(gpu, dtype)
    e = 2 if (train.bf16 or train.fp8) else 4

    model_f = flops(model, train, global_batch_size=gbs, causal=causal)
    # executed work: causal kernels skip the masked half whatever MFU's convention
    hw_f = hardware_flops(model, train, global_batch_size=gbs, causal=True)
    compute = hw_f / (world * peak * achievable_fraction)
    bubble_s = compute * bubble_time_ratio(parallel, m)

    s, b, h = model.seq_length // cp, train.micro_batch_size, model.hidden_size
    layers = max(model.layers_per_stage(pp))  # the busiest stage sets the pace
    act = s * b * h * e
    tp_s = cp_s = ep_s = pp_s = 0.0
    if tp > 1:
        per_layer = 4 + (2 if train.recompute == "full" else 0)
        nbytes = layers * m * per_layer * 2 * (tp - 1) / tp * act
        tp_s = nbytes / _link(dev, 1, tp, gpus_per_node)
    if cp > 1:
        kv = model.query_groups * model.head_dim
        nbytes = layers * m * 3 * (cp - 1) * s * b * 2 * kv * e / tp
        cp_s = nbytes / _link(dev, tp, cp, gpus_per_node)
    if ep > 1 and model.is_moe:
        nbytes = layers * m * 4 * (ep - 1) / ep * act * model.moe_router_topk / tp
        ep_s = nbytes / _link(dev, tp * cp, ep, gpus_per_node)
    if pp > 1:
        nbytes = 2 * m * act / (tp if parallel.sequence_parallel else 1)
        pp_s = nbytes / _link(dev, tp * cp * dp, pp, gpus_per_node)
    dp_s = 0.0
    if dp * cp > 1:
        nbytes = dp_traffic(model, parallel, train, num_microbatches=m).sent_bytes()
        dp_s = nbytes / _link(dev, tp, dp * cp, gpus_per_node)
    return StepTimeEstimate(
        compute_s=compute,
        bubble_s=bubble_s,
        tp_comm_s=tp_s,
        cp_comm_s=cp_s,
        ep_comm_s=ep_s,
        pp_comm_s=pp_s,
        dp_comm_s=dp_s,
        model_flops=model_f,
        hardware_flops=hardware_flops(model, train, global_batch_size=gbs, causal=causal),
        tokens_per_step=gbs * model.seq_length,
        num_gpus=world,
        peak_flops=peak,
    )


def _link(dev: hardware.Device, stride: int, size: int, gpus_per_node: int) -> float:
    """The first-order model's bandwidth: the link's nominal rate."""
    return dev.intra_node_bytes_per_s if stride * size <= gpus_per_node else dev.inter_node_bytes_per_s
