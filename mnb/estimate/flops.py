"""Model FLOPs per step (Megatron-LM's formula) and MFU.

Formula: Megatron-LM ``megatron/training/training.py``,
``num_floating_point_operations(args, batch_size)`` (derivation in Narayanan
et al. 2021, arXiv 2104.04473, appendix "Floating-point operations").  Per
token, with 3 = forward + two backward GEMMs and 2 = multiply-add::

    6*h*(ffn*f*N_dense + moe_ffn*k*f*N_moe)        MLP, f = 3 SwiGLU / 2 otherwise, k = top-k
  + N_layers * 6*(h*(q + 2*kv) + q*h)              QKV and output projections (GQA: kv < q)
  + N_layers * 6*q*s * c                           core attention QK^T and (QK^T)V
  + 6*h*V_pad                                      logits

``c`` is 2 for the full s*s score matrix (``causal=False``, the default) and 1
for causal attention counted as half of it (``causal=True``).  Versions:
Megatron-LM releases contemporary with megatron-core 0.16 and earlier count the
full matrix (the ``12*B*s*L*h^2*(1 + g/a + s/h)...`` form), as does PaLM's MFU
definition (Chowdhery et al. 2022, appendix B) and mnb's rank-side
``model_flops_per_step``; Megatron-LM from mid-2025 on (the megatron/training
shipped with megatron-core 0.19) halves it for causal masks.  Pass
``causal=True`` to compare with those newer logs.  Model FLOPs exclude
recomputation (that is what MFU divides by); :func:`hardware_flops` adds it.

    >>> import mnb.estimate as est
    >>> from mnb.config import TrainConfig
    >>> f = est.flops("llama-7b", TrainConfig(global_batch_size=128))
    >>> round(f / 1e15, 1)    # PFLOP per step of 128 x 4096 tokens
    24.2
"""

from __future__ import annotations

from mnb.config import ModelConfig, TrainConfig

from . import hardware
from ._inputs import as_model, as_train, padded_vocab_size


def _batch(train: TrainConfig, global_batch_size: int | None) -> int:
    gbs = global_batch_size or train.global_batch_size or train.micro_batch_size
    if not isinstance(gbs, int) or gbs < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {gbs!r}")
    return gbs


def flops_per_token(model: ModelConfig, *, causal: bool = False, seq_length: int | None = None) -> float:
    """Model FLOPs (forward + backward) per token; see the module docstring."""
    s = seq_length or model.seq_length
    h, layers = model.hidden_size, model.num_layers
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    f = 3 if model.gated_linear_unit else 2
    if model.is_moe:
        mlp = 6 * h * model.moe_ffn * model.moe_router_topk * f * layers
    else:
        mlp = 6 * h * model.ffn * f * layers
    attention = layers * 6 * (h * (q + 2 * kv) + q * h)
    core = layers * 6 * q * s * (1 if causal else 2)
    logits = 6 * h * padded_vocab_size(model, 1)
    return mlp + attention + core + logits


def flops(
    model: str | ModelConfig | dict,
    train: TrainConfig | dict | None = None,
    *,
    global_batch_size: int | None = None,
    causal: bool = False,
) -> float:
    """Model FLOPs of one training step (the whole global batch, all ranks together).

    Batch: ``global_batch_size`` if given, else ``train.global_batch_size``,
    else ``train.micro_batch_size`` (one microbatch, dp = 1).  Sequence length:
    ``model.seq_length``.  ``causal`` is documented in the module docstring.
    """
    model = as_model(model)
    train = as_train(train)
    gbs = _batch(train, global_batch_size)
    return gbs * model.seq_length * flops_per_token(model, causal=causal)


def hardware_flops(
    model: str | ModelConfig | dict,
    train: TrainConfig | dict | None = None,
    *,
    global_batch_size: int | None = None,
    causal: bool = False,
    recompute: str | None = None,
) -> float:
    """FLOPs actually executed: model FLOPs plus recomputation.

    Full recompute repeats every layer's forward (1/3 of the layer FLOPs);
    selective recompute (core attention) repeats the forward of QK^T and
    (QK^T)V, 1/3 of the core-attention term.
    """
    model = as_model(model)
    train = as_train(train)
    recompute = recompute or train.recompute
    gbs = _batch(train, global_batch_size)
    tokens = gbs * model.seq_length
    total = tokens * flops_per_token(model, causal=causal)
    logits = 6 * model.hidden_size * padded_vocab_size(model, 1)
    q = model.num_attention_heads * model.head_dim
    core = model.num_layers * 6 * q * model.seq_length * (1 if causal else 2)
    if recompute == "full":
        total += tokens * (flops_per_token(model, causal=causal) - logits) / 3
    elif recompute == "selective":
        total += tokens * core / 3
    return total


def mfu(
    model: str | ModelConfig | dict | None = None,
    train: TrainConfig | dict | None = None,
    *,
    step_time_s: float,
    num_gpus: int,
    gpu: str | None = "h200",
    peak_flops: float | None = None,
    flops_per_step: float | None = None,
    dtype: str | None = None,
    causal: bool = False,
) -> float:
    """Model FLOPs utilisation: model FLOPs per step / (step time * GPUs * peak).

    Give either ``model`` (+ ``train``) or ``flops_per_step``.  The peak is
    ``peak_flops`` (FLOP/s per device) if given, else the hardware table entry
    ``gpu`` ('h100', 'h200', 'h200-measured', 'a100', 'b200', 'cpu') for
    ``dtype`` (default from ``train``: bf16/fp8/fp32).

        mnb.estimate.mfu("llama-7b", TrainConfig(global_batch_size=128, bf16=True),
                         step_time_s=6.0, num_gpus=8, gpu="h200")
    """
    if step_time_s is None or step_time_s <= 0:
        raise ValueError(f"step_time_s must be positive, got {step_time_s!r}")
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"num_gpus must be a positive integer, got {num_gpus!r}")
    if flops_per_step is None:
        if model is None:
            raise ValueError("mfu needs a model (and train) or flops_per_step=")
        flops_per_step = flops(model, train, causal=causal)
    if peak_flops is None:
        if gpu is None:
            raise ValueError("mfu needs gpu= (a hardware-table name) or peak_flops=")
        if dtype is None:
            t = as_train(train)
            dtype = hardware.train_dtype(t.bf16, t.fp8) if train is not None else "bf16"
        peak_flops = hardware.peak_flops(gpu, dtype)
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return flops_per_step / (step_time_s * num_gpus * peak_flops)
