"""FP8 GEMMs in the parallel linears of the local spec, without Transformer Engine.

``mnb.gpt(..., fp8="tensorwise" | "rowwise" | "delayed")`` swaps the matmul inside each transformer
layer's ``ColumnParallelLinear`` / ``RowParallelLinear`` (``_forward_impl``, the call Megatron
makes with the already-split input) for :class:`FP8Linear`, a ``torch.autograd.Function`` that
runs the forward GEMM and both backward GEMMs (input gradient, weight gradient) through
``torch._scaled_mm``.  Everything around the matmul stays Megatron's: the sequence-parallel
all-gather of the input (bf16, in forward and again in backward), the tensor-parallel all-reduce
or reduce-scatter of the input gradient, the RowParallelLinear's output reduction, the pipeline,
data-parallel and FSDP machinery.  Master weights, the optimizer and the weight gradient (returned
in the weights' dtype; Megatron's DDP hook adds it into the fp32 ``main_grad``) are as without FP8.

Recipes (torchao's names and scalings, ``torchao.float8.config.Float8LinearRecipeName``):

- ``"tensorwise"``: one scale per tensor; input and weight E4M3, output gradient E5M2 (more range,
  less precision: torchao's default and Transformer Engine's "hybrid" format).
- ``"rowwise"``: one scale per row of each operand along the contracted dimension, all E4M3, scales
  rounded down to powers of two (torchao's ``rowwise`` recipe).  Each backward GEMM re-scales its
  operands along its own contracted dimension, so the saved input stays bf16.
- ``"delayed"``: tensorwise's formats, with the activations' and gradients' scales taken inside a
  training step from an amax history of their linear's last casts (Transformer Engine's default
  ``DelayedScaling``, ``amax_compute_algo="max"``): one pass over each tensor instead of two, by mnb's own
  kernel (:mod:`mnb.megatron.fp8_delayed`).  Weights are scaled by their own amax, once a step.

Otherwise scales are computed from the tensor in hand at every call ("current" or "dynamic" scaling, as
torchao does).  The casts use torchao's
primitives (``tensor_to_scale``, ``to_fp8_saturated``, ``addmm_float8_unwrapped``) and are compiled
(one fused amax + scale + cast per operand: the eager casts cost as much as the FP8 GEMM saves); a
cast whose data a backward GEMM takes contracted over the tokens writes that transposed layout
itself (:func:`cast_layouts`), as Transformer Engine's cast-transpose does.
Inside a training step (:func:`weight_cache`) each weight is cast once per step, not per microbatch.

The output layer (logits) and the core attention stay bf16, as in torchao's and TE's recipes.

Needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell),
bf16 training (``mnb.train(..., bf16=True)``) and torchao (``pip install 'mnb[fp8]'``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from mnb.config import ModelConfig
from mnb.fields import choices
from mnb.megatron import fp8_delayed

log = logging.getLogger(__name__)

RECIPES = choices(ModelConfig, "fp8")
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
MIN_CAPABILITY = (8, 9)
ALIGN = 16
"""``torch._scaled_mm`` needs every dimension of its operands to be a multiple of 16."""
RUN_ON_CPU = False
"""Tests only: let CPU ranks run the FP8 path through torch's CPU ``_scaled_mm`` (the same Function and
communication, far slower than bf16 there); users' CPU ranks are refused (:func:`refusal`)."""


def refusal(device: torch.device) -> str:
    """Why this rank cannot run FP8 GEMMs ('' when it can): checked before any collective."""
    if device.type != "cuda" and RUN_ON_CPU:
        return ""
    if device.type != "cuda":
        return (f"fp8 GEMMs need a GPU with FP8 tensor cores (compute capability >= 8.9); this rank runs "
                f"on {device.type.upper()} (gloo) where torch has no fast FP8 matmul: drop fp8= here, or use a "
                "GPU pool")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"fp8 GEMMs need FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell); "
                f"{name} has {capability[0]}.{capability[1]}: drop fp8=")
    try:
        import torchao.float8.float8_utils  # noqa: F401
    except ImportError:
        return "fp8 GEMMs on the local spec use torchao's float8 primitives: pip install 'mnb[fp8]' (torchao)"
    return ""


# -- casting -------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _make_cast():
    """The cast over torchao's primitives (imported here, once, so that the compiled copy traces no import)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    def cast_fn(x: torch.Tensor, dtype: torch.dtype, axis: int | None, pow2: bool, rows: bool = True,
                transposed: bool = False):
        granularity = ScalingGranularity.TENSORWISE if axis is None else ScalingGranularity.AXISWISE
        scale = tensor_to_scale(x, dtype, scaling_granularity=granularity, axiswise_dim=axis,
                                round_scales_to_power_of_2=pow2)
        data = to_fp8_saturated(x.to(torch.float32) * scale, dtype)
        return data if rows else None, data.t().contiguous() if transposed else None, scale

    return cast_fn


def _cast_eager(x: torch.Tensor, dtype: torch.dtype, axis: int | None, pow2: bool):
    """``(fp8 data, scale)`` of ``x`` with ``data = saturate(x * scale)``: one scale for the whole
    tensor (``axis=None``) or one per slice along ``axis`` (the amax over ``axis``, kept as a dim)."""
    data, _, scale = _make_cast()(x, dtype, axis, pow2)
    return data, scale


@functools.lru_cache(maxsize=1)
def _cast_compiled():
    # one compiled graph per (width, dtype, axis, layouts): a handful per model
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64))
    return torch.compile(_make_cast(), dynamic=False)


COMPILE_ON_CPU = False
"""Tests only: compile the casts of CPU tensors too (Inductor's C++ backend), to check what GPUs compile."""
_compile_failed: list[str] = []
"""Why the compiled cast failed in this process, if it did (the eager cast serves from then on)."""


def cast_layouts(x: torch.Tensor, dtype: torch.dtype, axis: int | None, pow2: bool, *, rows: bool = True,
                 transposed: bool = False):
    """``(data, data_t, scale)`` of an activation or gradient ``x [tokens, width]``: the fp8 data as
    :func:`_cast_eager` makes it (``rows``, else None) and its transpose laid out row by row,
    ``data.t().contiguous()`` (``transposed``, else None), both written by the one cast.

    Why: a backward GEMM wants an operand contracted over the tokens; as a separate copy of the
    1-byte data (``.t().contiguous()``) that took a pass of its own, reading across rows.  Compiled on
    CUDA (a fused amax, then one kernel writing both layouts), one graph per width, dtype, axis and
    layouts; the token count is symbolic, so every micro batch size and sequence length shares it
    (widths stay static: symbolic widths ran far below bandwidth).  A compile that fails is said once
    and the eager cast serves."""
    if (x.is_cuda or COMPILE_ON_CPU) and not _compile_failed:
        torch._dynamo.mark_dynamic(x, 0)
        try:
            return _cast_compiled()(x, dtype, axis, pow2, rows, transposed)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # noqa: BLE001 - Inductor could not build it: the same arithmetic eagerly
            result = _make_cast()(x, dtype, axis, pow2, rows, transposed)  # raises where the input is the fault
            _compile_failed.append(f"{type(error).__name__}: {error}")
            log.warning("mnb's compiled FP8 cast failed (%s); casting eagerly from now on", _compile_failed[0])
            return result
    return _make_cast()(x, dtype, axis, pow2, rows, transposed)


def cast(x: torch.Tensor, dtype: torch.dtype, axis: int | None, pow2: bool):
    """``(fp8 data, scale)`` of ``x`` by :func:`cast_layouts` (the data row by row only)."""
    data, _, scale = cast_layouts(x, dtype, axis, pow2)
    return data, scale


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, *, fast_accum: bool) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)`` in ``out_dtype``: ``a`` row-major ``[m, k]``, ``b``
    column-major ``[k, n]``; scales scalar, or ``[m, 1]`` and ``[1, n]`` (torchao's
    ``addmm_float8_unwrapped``: ``torch._scaled_mm`` with the inverse scales)."""
    from torchao.float8.float8_ops import addmm_float8_unwrapped

    return addmm_float8_unwrapped(a, a_scale, b, b_scale, out_dtype, use_fast_accum=fast_accum)


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same ``[k, n]`` values laid out column by column (what ``_scaled_mm`` wants for ``b``)."""
    return t.t().contiguous().t()


@dataclass(frozen=True)
class Recipe:
    """Which dtype and scaling each operand of each GEMM gets."""

    name: str
    grad_dtype: torch.dtype
    rowwise: bool
    delayed: bool = False
    """Activations and gradients scaled from an amax history inside a training step (:mod:`mnb.megatron.fp8_delayed`)."""

    @property
    def pow2(self) -> bool:
        return self.rowwise

    def axis(self, along: int) -> int | None:
        """The amax axis for scales that vary along the other dim (rowwise) or None (tensorwise)."""
        return along if self.rowwise else None


def recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"fp8 must be one of {', '.join(map(repr, RECIPES))} (or None), got {name!r}")
    return Recipe(name=name, grad_dtype=E4M3 if name == "rowwise" else E5M2, rowwise=name == "rowwise",
                  delayed=name == "delayed")


# -- the weights, once per step --------------------------------------------------------------------

_step_cache: dict | None = None


@contextlib.contextmanager
def weight_cache():
    """Within a training step's forward-backward, cast each weight to FP8 once (weights only change
    at the optimizer step, which is outside); outside it every call casts afresh."""
    global _step_cache
    outer, _step_cache = _step_cache, {}
    try:
        yield
    finally:
        _step_cache = outer


def _weight(weight: torch.Tensor, rc: Recipe, for_dgrad: bool, owner: torch.Tensor):
    """``(data, scale)`` of the weight ``[n, k]``: for the forward (scales per output row ``[n, 1]``,
    data row-major) or for the input gradient (scales per input column ``[1, k]``, data column-major).

    ``owner``: the parameter the linear was called with (the cache's key; the tensors a backward
    unpacks are new Python objects each time, whose ids are recycled)."""
    key = (id(owner), for_dgrad)
    if _step_cache is not None and key in _step_cache:
        return _step_cache[key][1]
    w = weight.detach()  # eager: once per step in training, and no compile per weight shape
    if for_dgrad:
        data, scale = _cast_eager(w, E4M3, rc.axis(0), rc.pow2)
        out = column_major(data), scale
    else:
        out = _cast_eager(w, E4M3, rc.axis(-1), rc.pow2)
    if _step_cache is not None:
        _step_cache[key] = (owner, out)  # holding the owner keeps its id from being reused in the step
    return out


# -- the autograd Function -----------------------------------------------------------------------

def _check_tokens(tokens: int) -> None:
    if tokens % ALIGN:
        raise ValueError(
            f"fp8 GEMMs need token counts that are multiples of {ALIGN} (torch._scaled_mm); a linear got {tokens} "
            f"tokens: make seq_length / cp * micro_batch_size a multiple of {ALIGN}")


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    from megatron.core.tensor_parallel import layers  # read at call time: mnb's CPU mode may patch it

    size = list(x.shape)
    size[0] *= group.size()
    out = torch.empty(size, dtype=x.dtype, device=x.device)
    layers.dist_all_gather_func(out, x.contiguous(), group=group)
    return out


class FP8Linear(torch.autograd.Function):
    """``input @ weight.T (+ bias)`` with the three GEMMs in FP8 and Megatron's tp communication.

    Same contract as Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` (without
    apex's fused weight-gradient accumulation, which the local spec does not use):
    ``sequence_parallel`` all-gathers the input over ``tp_group`` (and reduce-scatters its
    gradient), ``allreduce_dgrad`` all-reduces the input gradient.  ``histories``: the linear's
    ``(inputs, output gradients)`` amax histories, which a delayed recipe casts from inside a training step
    (:func:`weight_cache`); elsewhere each tensor is scaled by its own amax.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, rc: Recipe, allreduce_dgrad: bool, sequence_parallel: bool, tp_group,
                histories=None):
        total = _all_gather(input, tp_group) if sequence_parallel else input
        k = total.shape[-1]
        x = total.reshape(-1, k)
        _check_tokens(x.shape[0])
        w_data, w_scale = _weight(weight, rc, for_dgrad=False, owner=weight)
        # tensorwise: the wgrad GEMM reuses the forward's cast (half the input's bytes), in the layout it takes
        ctx.fp8_input = not rc.rowwise and not sequence_parallel
        ctx.histories = histories if rc.delayed and histories is not None and _step_cache is not None else None
        if ctx.histories:
            x_data, x_t, x_scale = fp8_delayed.cast(x, E4M3, ctx.histories[0], transposed=ctx.fp8_input)
        else:
            x_data, x_t, x_scale = cast_layouts(x, E4M3, rc.axis(-1), rc.pow2, transposed=ctx.fp8_input)
        out = scaled_mm(x_data, x_scale, w_data.t(), w_scale.t(), total.dtype, fast_accum=True)
        if bias is not None:
            out = out + bias
        if ctx.fp8_input:
            ctx.save_for_backward(x_t, x_scale, weight)
        else:
            ctx.save_for_backward(input, weight)
        ctx.rc, ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = rc, allreduce_dgrad, sequence_parallel, tp_group
        ctx.use_bias, ctx.input_shape = bias is not None, input.shape
        ctx.owner = weight if _step_cache is not None else None  # the cache's key (see _weight)
        return out.view(*total.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        rc = ctx.rc
        if ctx.fp8_input:
            x_t, x_scale, weight = ctx.saved_tensors
        else:
            input, weight = ctx.saved_tensors
        n = grad_output.shape[-1]
        g = grad_output.reshape(-1, n)
        if not g.is_contiguous():
            g = g.contiguous()
        # input gradient: g [t, n] @ W [n, k]
        # tensorwise: the gradient's one cast also gives the wgrad GEMM its transposed layout
        if ctx.histories:
            g_data, g_t, g_scale = fp8_delayed.cast(g, rc.grad_dtype, ctx.histories[1], transposed=True)
        else:
            g_data, g_t, g_scale = cast_layouts(g, rc.grad_dtype, rc.axis(-1), rc.pow2, transposed=not rc.rowwise)
        w_data, w_scale = _weight(weight, rc, for_dgrad=True, owner=ctx.owner)
        grad_input = scaled_mm(g_data, g_scale, w_data, w_scale, grad_output.dtype, fast_accum=False)
        handle = None
        group = ctx.tp_group
        if ctx.allreduce_dgrad:
            handle = torch.distributed.all_reduce(grad_input, group=group, async_op=True)
        elif ctx.sequence_parallel:
            from megatron.core.tensor_parallel import layers

            sub = torch.empty(ctx.input_shape, dtype=grad_input.dtype, device=grad_input.device)
            handle = layers.dist_reduce_scatter_func(sub, grad_input.view(-1, *ctx.input_shape[1:]),
                                                     group=group, async_op=True)
        # weight gradient: g.T [n, t] @ x [t, k], both scaled along t; x column-major, as x_t.t() is
        if not ctx.fp8_input:
            total = _all_gather(input, group) if ctx.sequence_parallel else input
            total = total.reshape(-1, total.shape[-1])
            if ctx.histories:  # the forward's input again: its history records it a second time, harmlessly
                _, x_t, x_scale = fp8_delayed.cast(total, E4M3, ctx.histories[0], rows=False, transposed=True)
            else:
                _, x_t, x_scale = cast_layouts(total, E4M3, rc.axis(0), rc.pow2, rows=False, transposed=True)
        if rc.rowwise:
            _, gw_data, gw_scale = cast_layouts(g, rc.grad_dtype, 0, rc.pow2, rows=False, transposed=True)
            gw_scale = gw_scale.t()
        else:
            gw_data, gw_scale = g_t, g_scale
        grad_weight = scaled_mm(gw_data, gw_scale, x_t.t(), x_scale, weight.dtype, fast_accum=False)
        grad_bias = g.sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        if ctx.sequence_parallel:
            grad_input = sub
        else:
            grad_input = grad_input.view(ctx.input_shape)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _forward_impl(module, rc: Recipe, input, weight, bias=None, gradient_accumulation_fusion=False,
                  allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=None,
                  tp_group=None, **rest: Any):
    """What ``ColumnParallelLinear`` / ``RowParallelLinear`` call as ``self._forward_impl(...)``."""
    if not weight.requires_grad or grad_output_buffer is not None or gradient_accumulation_fusion:
        # frozen weights (adapters), deferred embedding wgrads, apex's fused accumulation: Megatron's own
        return type(module)._forward_impl(module, input, weight, bias=bias,
                                          gradient_accumulation_fusion=gradient_accumulation_fusion,
                                          allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                                          grad_output_buffer=grad_output_buffer, tp_group=tp_group, **rest)
    if tp_group is None and (allreduce_dgrad or sequence_parallel):
        tp_group = getattr(module, "tp_group", None)
        if tp_group is None:
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
    return FP8Linear.apply(input, weight, bias, rc, bool(allreduce_dgrad), bool(sequence_parallel), tp_group,
                           getattr(module, "fp8_amax", None))


def install(chunks, name: str) -> int:
    """Run the transformer layers' parallel linears of ``chunks`` in FP8 (recipe ``name``); the count."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    rc = recipe(name)
    count = 0
    for chunk in chunks:
        for path, module in chunk.named_modules():
            if ".layers." not in f".{path}." or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue  # the output layer (logits) stays bf16
            out_features, in_features = module.weight.shape
            if out_features % ALIGN or in_features % ALIGN:
                raise ValueError(
                    f"fp8={name!r}: {path} is {out_features} x {in_features} on this rank, and torch._scaled_mm "
                    f"needs multiples of {ALIGN}; choose widths (hidden_size, ffn_hidden_size, heads x kv_channels) "
                    f"whose share per tp rank is a multiple of {ALIGN}, or drop fp8=")
            module._forward_impl = functools.partial(_forward_impl, module, rc)
            module.fp8_recipe = name
            if rc.delayed:
                module.fp8_amax = (fp8_delayed.AmaxHistory(), fp8_delayed.AmaxHistory())  # inputs, output gradients
                if count == 0:  # its probe builds the cast kernels now, not inside the first step's forward
                    fp8_delayed.runs_on(module.weight.device)
            count += 1
    return count


def installed(chunks) -> str | None:
    """The recipe the chunks' linears run in, or None."""
    for chunk in chunks:
        for module in chunk.modules():
            if getattr(module, "fp8_recipe", None):
                return module.fp8_recipe
    return None
