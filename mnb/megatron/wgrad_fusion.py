"""Weight gradients accumulated into Megatron's fp32 ``main_grad`` by the GEMM itself, without apex.

Why: without apex, Megatron-Core's linears compute each weight gradient as a bf16 tensor and
Megatron DDP's hook then adds it into the fp32 ``main_grad`` (a read of the gradient and of
``main_grad``, a write of ``main_grad``: 10 bytes per parameter and microbatch; about 0.12 s of a
llama-3b step on an H200, issue 39's profile).  With ``gradient_accumulation_fusion`` Megatron calls
apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output, main_grad)``
instead: one GEMM of bf16 operands that adds its product into ``main_grad`` in fp32 (cuBLAS's
``beta = 1``), and hands DDP a placeholder gradient marked ``grad_added_to_main_grad``.  torch has that
GEMM (``torch.addmm(..., out_dtype=torch.float32)`` on CUDA): :data:`KERNELS` is apex's two functions
made of it, and :func:`fused` turns Megatron's switch on for the linears that Megatron DDP wraps while
``mnb.train`` steps, and off again after (a cell's own ``loss.backward()`` on a model without DDP has
no ``main_grad``).

The result differs from the unfused path by rounding only: the product is added in fp32 instead of
first being rounded to bf16 (apex's arithmetic).  Not used on CPU ranks, under Megatron-FSDP (which
has its own path), for frozen weights (LoRA) or FP8 linears (:mod:`mnb.megatron.fp8` runs its own
weight-gradient GEMM).  The estimators predict by the same rule
(:func:`mnb.estimate.kernels.fuses_weight_gradients`): a change here changes it there.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace
from typing import Iterator

import torch

log = logging.getLogger(__name__)

enabled = True
"""False: mnb.train leaves Megatron's switch off (comparisons: bench/h200_limits.py)."""
ON_CPU = False
"""Tests only: CPU ranks too (fp32 training: the same-dtype ``addmm_`` path), to check the plumbing."""
calls = {"fp32": 0, "same_dtype": 0}
"""How many weight gradients each kernel accumulated (tests and diagnostics)."""


def _add_product(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output.T @ total_input`` in one GEMM, accumulated and written in fp32."""
    if total_input.dtype == torch.float32:  # fp32 training: the plain GEMM already accumulates in fp32
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)


def _accumulate_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    calls["fp32"] += 1
    _add_product(total_input, grad_output, main_grad)


def _accumulate_same_dtype(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    calls["same_dtype"] += 1
    main_grad.addmm_(grad_output.t(), total_input)


KERNELS = SimpleNamespace(wgrad_gemm_accum_fp32=_accumulate_fp32, wgrad_gemm_accum_fp16=_accumulate_same_dtype)
"""Stands in for apex's ``fused_weight_gradient_mlp_cuda`` (its two functions, their arguments)."""


_probed: dict[str, bool] = {}


def available(device: torch.device) -> bool:
    """Whether this torch adds a bf16 GEMM into an fp32 tensor in place on ``device`` (CUDA only; probed
    once per process on a small GEMM against the unfused sum, so a torch without it trains unfused)."""
    if device.type != "cuda":
        return ON_CPU
    key = str(device)
    if key not in _probed:
        _probed[key] = _probe(device)
    return _probed[key]


def _probe(device: torch.device) -> bool:
    if "dtype_out" not in torch.ops.aten.addmm.overloads():
        return False
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        x, g = (torch.randn(64, n, device=device, generator=generator).bfloat16() for n in (32, 48))
        main_grad = torch.randn(48, 32, device=device, generator=generator)
        expected = main_grad + g.float().t() @ x.float()
        _add_product(x, g, main_grad)
        return bool(torch.allclose(main_grad, expected, rtol=1e-3, atol=1e-3))
    except Exception as error:  # noqa: BLE001 - no fused GEMM here: Megatron's unfused path
        log.warning("weight gradients are added by DDP's hook (torch.addmm with out_dtype failed: %s)", error)
        return False


def install() -> None:
    """Make Megatron's linears find :data:`KERNELS` where they look for apex's extension (kept if apex is there)."""
    from megatron.core.tensor_parallel import layers

    if not getattr(layers, "_grad_accum_fusion_available", False):
        layers.fused_weight_gradient_mlp_cuda = KERNELS
        layers._grad_accum_fusion_available = True


def _linears(chunks) -> list:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    found = []
    for chunk in chunks:
        for module in chunk.modules():
            weight = getattr(module, "weight", None)
            if (isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and weight is not None
                    and weight.requires_grad and hasattr(weight, "main_grad")
                    and not hasattr(weight, "__fsdp_param__")
                    and "_forward_impl" not in vars(module)  # an FP8 linear (mnb.megatron.fp8.install)
                    and getattr(module, "gradient_accumulation_fusion", None) is False):
                found.append(module)
    return found


@contextlib.contextmanager
def fused(chunks, device: torch.device) -> Iterator[int]:
    """Megatron's ``gradient_accumulation_fusion`` on for the trainable DDP-wrapped linears of ``chunks``
    but FP8 ones inside the block (yields how many), restored after; a no-op where :func:`available`
    says no or when :data:`enabled` is False."""
    if not enabled or not available(device):
        yield 0
        return
    install()
    linears = _linears(chunks)
    try:
        for module in linears:
            module.gradient_accumulation_fusion = True
        yield len(linears)
    finally:
        for module in linears:
            module.gradient_accumulation_fusion = False
