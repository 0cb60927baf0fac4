"""Time of one microbatch through one pipeline stage, by kind of work, on one GPU.

The step-time model (:mod:`mnb.estimate.timing`) adds these up per stage and
combines the stages with the schedule.  Per transformer layer on a tp rank,
with T = micro batch x sequence / cp tokens:

- **GEMMs** (QKV, attention projection, fc1, fc2, MoE experts; the logits on the
  last stage): forward ``(m, n, k)`` = ``(T, out/tp, in)`` for column-parallel and
  ``(T, out, in/tp)`` for row-parallel weights; backward adds the data gradient
  ``(m, k, n)`` and the weight gradient ``(k, n, m)``.  Each runs at the device's
  GEMM curve for its effective size ``3/(1/m+1/n+1/k)``
  (:mod:`mnb.estimate.calibration`).
- **core attention** at its own efficiency: flash/SDPA kernels skip the masked
  half of a causal score matrix; Megatron's unfused attention computes all of
  it as batched GEMMs and moves the s x s scores through softmax and dropout
  (counted as memory traffic).
- **elementwise and norms** from memory bandwidth: bytes each kernel reads and
  writes (norms, residual adds, dropout masks, GeLU/SwiGLU, RoPE, the loss), at
  the device's ``memory_efficiency`` share of HBM bandwidth.  Norms, residuals and
  dropout run on the sequence shard with sequence parallelism, replicated on
  every tp rank without it.
- **recompute**: full recompute repeats each layer's forward in the backward;
  selective repeats core attention's forward.
- **gradient accumulation**: without ``gradient_accumulation_fusion`` (TE, apex,
  or mnb's stand-in on GPUs), each microbatch adds every weight gradient into Megatron's fp32
  ``main_grad`` (read the gradient and ``main_grad``, write ``main_grad``: 2 + 4 + 4
  bytes per parameter with fp32 ``main_grad``); with it, only the parameters outside the
  parallel linears are added that way (the word and position embeddings, norms; a tied output
  layer's gradient lands in the embedding's).  :func:`fuses_weight_gradients` is when mnb's own
  training fuses, the estimators' default.

Pass counts are per token and layer, forward / backward, in elements of the
training dtype; they are the kernels' own reads and writes, not a fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from mnb.config import ModelConfig, ParallelConfig, TrainConfig

from ._inputs import dropout, padded_vocab_size
from .hardware import Device
from .params import stage_params

ATTENTION_KINDS = ("flash", "unfused")


@lru_cache(maxsize=4096)
def gemm_fraction(dev: Device, m: float, n: float, k: float) -> float:
    """Fraction of peak a GEMM of this shape reaches on ``dev`` (the device's curve)."""
    if min(m, n, k) <= 0:
        return 1.0
    d = 3.0 / (1.0 / m + 1.0 / n + 1.0 / k)
    curve = dev.gemm_curve
    if d <= curve[0][0]:
        return curve[0][1]
    for (d0, f0), (d1, f1) in zip(curve, curve[1:]):
        if d <= d1:
            t = (math.log2(d) - math.log2(d0)) / (math.log2(d1) - math.log2(d0))
            return f0 + t * (f1 - f0)
    return curve[-1][1]


@lru_cache(maxsize=4096)
def gemm_time(dev: Device, peak: float, m: float, n: float, k: float, *, backward: bool = False) -> float:
    """Seconds of one GEMM (``backward``: its data- and weight-gradient GEMMs instead)."""
    shapes = [(m, k, n), (k, n, m)] if backward else [(m, n, k)]
    return sum(2 * m * n * k / (peak * gemm_fraction(dev, *s)) for s in shapes)


@dataclass(frozen=True)
class StageWork:
    """One microbatch through one stage: seconds by kind (forward + backward)."""

    gemm_s: float
    attention_s: float
    memory_s: float
    recompute_s: float
    grad_accumulation_s: float
    forward_s: float
    """Of the above, the forward (what an overlapped param all-gather can hide behind)."""
    backward_s: float
    gemm_per_layer_s: float
    """Forward + backward GEMM time of one layer (what overlapped tp comm hides behind)."""

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.memory_s + self.recompute_s + self.grad_accumulation_s


def _layer_gemms(model: ModelConfig, parallel: ParallelConfig, tokens: float) -> list[tuple[float, float, float, int]]:
    """(m, n, k, count) of one layer's forward GEMMs on one tp rank."""
    tp, h = parallel.tp, model.hidden_size
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    gate = 2 if model.gated_linear_unit else 1
    shapes = [(tokens, (q + 2 * kv) / tp, h, 1), (tokens, h, q / tp, 1)]
    if model.is_moe:
        experts = model.num_moe_experts
        local = experts // parallel.ep
        per_expert = tokens * model.moe_router_topk * parallel.ep / experts
        shapes += [(per_expert, gate * model.moe_ffn / tp, h, local), (per_expert, h, model.moe_ffn / tp, local)]
    else:
        shapes += [(tokens, gate * model.ffn / tp, h, 1), (tokens, h, model.ffn / tp, 1)]
    return shapes


def _layer_bytes(model: ModelConfig, parallel: ParallelConfig, attention: str, e: int) -> tuple[float, float]:
    """(forward, backward) bytes per token of one layer's elementwise and norm kernels."""
    tp, h = parallel.tp, model.hidden_size
    hs = h / tp if parallel.sequence_parallel else h
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    ffn = (model.moe_ffn * model.moe_router_topk) if model.is_moe else model.ffn
    fwd = 2 * 2 * hs + 2 * 3 * hs  # two norms (read x, write y), two residual adds
    bwd = 2 * 3 * hs + 2 * 3 * hs  # norm backward (x, dy -> dx), gradient sums at the forks
    if dropout(model, "hidden_dropout") > 0:  # two dropouts: a 1-byte mask, applied again backward
        fwd += 2 * 1.5 * hs
        bwd += 2 * 2.5 * hs
    if model.gated_linear_unit:  # SwiGLU: read 2f write f; backward read 2f + df, write 2f
        fwd += 3 * ffn / tp
        bwd += 5 * ffn / tp
    else:  # GeLU: read f write f; backward read f + df, write df
        fwd += 2 * ffn / tp
        bwd += 3 * ffn / tp
    if model.position_embedding_type == "rope":
        fwd += 2 * (q + kv) / tp
        bwd += 2 * (q + kv) / tp
    if attention == "unfused":  # softmax over the s x s scores of this rank's heads (+ dropout)
        scores = model.num_attention_heads / tp * model.seq_length / parallel.cp
        drop = dropout(model, "attention_dropout") > 0
        fwd += scores * (2 + (2.5 if drop else 0))
        bwd += scores * (3 + (2.5 if drop else 0))
    return fwd * e, bwd * e


FP8_GEMM_EFFICIENCY = 0.93
"""FP8 GEMMs reach a smaller share of their datasheet peak than bf16 ones: on one H200 (2026-12-03,
bench/gpu_fp8.py) 1480 of 1979 TFLOP/s against bf16's 793 of 989 for an 8192^3 product: 0.75 / 0.80."""
FP8_CAST_SLOWDOWN = 1.6
"""The FP8 casts (amax, scale, cast with the transposed copy; their launches) cost 1.6x their bytes at the
elementwise kernels' bandwidth: fitted to llama-1b, llama-3b and a 20-layer llama-8b on one H200 (2026-12-05,
bench/gpu_fp8.py; BENCHMARKS.md), where tensorwise FP8 linears measured 1.05, 1.04 and 1.03x bf16's tokens/s
and this model predicts 1.00, 1.05 and 1.06x (rowwise: measured 0.94, 0.81, 0.86x, predicted 0.86, 0.92,
0.96x).  It was 2.5 before the cast wrote the transposed copy itself (0.93, 0.97, 0.99x measured, 2026-12-03)."""


def fp8_cast_bytes(recipe: str, n: int, k: int) -> tuple[int, int]:
    """Bytes per token that the casts of one FP8 linear (``n`` outputs, ``k`` inputs) move, forward and backward.

    Current scaling reads a bf16 tensor twice (its amax, then the cast: 2 + 2 bytes an element) and writes
    1-byte data; ``"delayed"`` reads it once (the scale comes from the history, and the cast records the
    tensor's amax as it goes), so 2 bytes less per element cast.  Not measured apart: the casts' slowdown
    (:data:`FP8_CAST_SLOWDOWN`) is tensorwise's."""
    if recipe == "rowwise":
        return 5 * k, 12 * n + 7 * k
    if recipe == "delayed":
        return 3 * k, 5 * n + 2 * k
    return 5 * k, 7 * n + 2 * k


def fp8_peak(dev: Device, peak: float) -> float:
    """The FP8 GEMM peak beside ``peak`` (the device's bf16 peak, or the caller's replacement of it): scaled
    by the device's FP8 : bf16 ratio and :data:`FP8_GEMM_EFFICIENCY`.  ValueError for devices without FP8
    tensor cores in the table."""
    if not dev.fp8_flops:
        raise ValueError(f"{dev.label} has no FP8 peak in the hardware table (FP8 tensor cores: compute capability "
                         ">= 8.9); estimate this model without fp8=, or register the device with fp8_flops=")
    return peak * dev.fp8_flops / dev.bf16_flops * FP8_GEMM_EFFICIENCY


def fuses_weight_gradients(dev: Device, model: ModelConfig, parallel: ParallelConfig) -> bool:
    """Whether mnb's own training adds the linears' weight gradients into ``main_grad`` inside the GEMM
    (:mod:`mnb.megatron.wgrad_fusion`, Megatron's ``gradient_accumulation_fusion``): on GPUs, except for
    the FP8 linears of the local spec (``ModelConfig.fp8``: their own weight-gradient GEMM) and under
    Megatron-FSDP (its own gradient buffers).  The one statement of that rule on the notebook side:
    ``step_time``, ``plan`` and the explorer default to it; the rank side applies it per linear."""
    return dev.name != "cpu" and not model.fp8 and parallel.fsdp is None


def linear_params(model: ModelConfig, parallel: ParallelConfig, stage: int) -> int:
    """Weights of one rank's Megatron parallel linears in pipeline stage ``stage``: the layers' GEMM
    weights (experts' too) and an untied output layer; not embeddings, norms or a router."""
    width = round(sum(count * n * k for _m, n, k, count in _layer_gemms(model, parallel, 1)))
    layers = model.layers_per_stage(parallel.pp)[stage]
    total = layers * width
    if stage == parallel.pp - 1 and (not model.share_embeddings_and_output_weights or parallel.pp > 1):
        total += padded_vocab_size(model, parallel.tp) * model.hidden_size // parallel.tp
    return total


def stage_work(
    model: ModelConfig,
    parallel: ParallelConfig,
    train: TrainConfig,
    dev: Device,
    peak: float,
    stage: int,
    *,
    attention: str = "flash",
    gradient_accumulation_fusion: bool = False,
    grad_bytes: int = 4,
) -> StageWork:
    """Seconds of one microbatch's forward and backward through pipeline stage ``stage``."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {attention!r}")
    e = 2 if (train.bf16 or train.fp8) else 4
    layers = model.layers_per_stage(parallel.pp)[stage]
    tokens = train.micro_batch_size * model.seq_length / parallel.cp
    bandwidth = dev.hbm_bytes_per_s * dev.memory_efficiency

    gemm_f = gemm_b = 0.0
    linear_peak = fp8_peak(dev, peak) if model.fp8 else peak
    cast_f = cast_b = 0.0  # FP8 linears: bytes per token of the casts (amax read, read, 1-byte write; transposes)
    for m, n, k, count in _layer_gemms(model, parallel, tokens):
        gemm_f += count * gemm_time(dev, linear_peak, m, n, k)
        gemm_b += count * gemm_time(dev, linear_peak, m, n, k, backward=True)
        if model.fp8:
            forward, backward = fp8_cast_bytes(model.fp8, n, k)
            cast_f += FP8_CAST_SLOWDOWN * count * forward * m / tokens
            cast_b += FP8_CAST_SLOWDOWN * count * backward * m / tokens
    q = model.num_attention_heads * model.head_dim
    core = 4 * tokens * model.seq_length * q / parallel.tp  # forward FLOPs, full s x s
    if attention == "flash":
        attn_f = core / 2 / (peak * dev.flash_attention_fraction)  # the masked half is skipped
    else:
        attn_f = core / (peak * dev.unfused_attention_fraction)
    attn_b = 2 * attn_f
    bytes_f, bytes_b = _layer_bytes(model, parallel, attention, e)
    mem_f, mem_b = tokens * (bytes_f + cast_f) / bandwidth, tokens * (bytes_b + cast_b) / bandwidth

    recompute = 0.0
    if train.recompute == "full":
        recompute = layers * (gemm_f + attn_f + mem_f)
    elif train.recompute == "selective":
        recompute = layers * attn_f
    gemm, attn, mem = layers * (gemm_f + gemm_b), layers * (attn_f + attn_b), layers * (mem_f + mem_b)
    forward = layers * (gemm_f + attn_f + mem_f)

    h = model.hidden_size
    if stage == parallel.pp - 1:  # final norm, logits GEMM, loss: mnb's loss kernels pass over the logits three
        # times (read forward; read, and write their gradient, backward; Inductor's fused loss took four)
        vocab = padded_vocab_size(model, parallel.tp) / parallel.tp
        logits_f = gemm_time(dev, peak, tokens, vocab, h)
        gemm += logits_f + gemm_time(dev, peak, tokens, vocab, h, backward=True)
        loss = tokens * (5 * h + 3 * vocab) * e / bandwidth
        mem += loss
        forward += logits_f + loss / 2
    if stage == 0:  # embedding lookup and its gradient (fp32 scatter-add)
        mem += tokens * h * (e + 3 * 4) / bandwidth

    params = stage_params(model, parallel, stage).total
    if gradient_accumulation_fusion:
        params -= linear_params(model, parallel, stage)
    grad_acc = params * (e + 2 * grad_bytes) / bandwidth
    total = gemm + attn + mem + recompute + grad_acc
    return StageWork(
        gemm_s=gemm, attention_s=attn, memory_s=mem, recompute_s=recompute, grad_accumulation_s=grad_acc,
        forward_s=forward, backward_s=total - forward, gemm_per_layer_s=gemm_f + gemm_b,
    )
