"""The language model's cross entropy in Triton kernels, for fused models on GPU ranks.

Why: the loss reads the largest activation of a step, the ``[tokens, vocabulary / tp]`` logits (4.2 GB in
bf16 for llama-3b at micro batch 8, seq 2048).  Its compiled form (:func:`mnb.megatron.fusions.
vocab_parallel_cross_entropy`, Inductor's kernels) read them twice forward (the max, then the sum of exp and
the target's logit) and needed a compile before a fresh pool's first fused step; the steps before ran it
unfused, by blocks of tokens.  Here:

- forward: one program per token reads its logits once: the max and the sum of exp together (an online
  softmax: the running sum is rescaled when the max grows), and the target's logit.  Under tp the ranks'
  maxima and sums are combined with the same all-reduces as before (the sums rescaled to the global max);
- backward: one pass writes ``(softmax - one_hot(target)) * grad_loss`` in the logits' dtype.

Arithmetic: fp32, as Megatron's and the compiled loss; the sum of exp is accumulated in another order, so
the loss agrees to fp32 rounding, not bit for bit.  What the backward keeps is the compiled loss's: the
logits (not an fp32 copy), the targets and two fp32 numbers a token.

:func:`mnb.megatron.fusions.vocab_parallel_cross_entropy` calls :func:`cross_entropy` where :func:`applies`
(CUDA ranks with Triton, or the interpreter in tests); :data:`enabled` off leaves Inductor's kernels in
charge.  The kernels are in :mod:`mnb.megatron.loss_triton`, imported on first use.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from mnb.megatron.triton_support import by_pointer, interpreted, probe, serves

enabled = True
"""Off: the loss through the compiled kernels of :mod:`mnb.megatron.fusions` instead.  Set it before
``mnb.gpt``: a model built while it is on leaves its loss out of the background compile (switched off later, the
compiled loss compiles at its first use, on the training thread)."""
BLOCK = 4096
"""Logits a program takes at a time (forward: per step of its loop; backward: per program)."""
WARPS = 8
calls = {"forward": 0, "backward": 0}
"""Kernel launches in this process (tests and diagnostics)."""


def applies(logits: torch.Tensor) -> bool:
    """Whether :func:`cross_entropy` takes ``logits [tokens, vocabulary / tp]``: on, a plain tensor of a float
    dtype with contiguous rows, on a device where the kernels run."""
    return (enabled and by_pointer(logits) and logits.dim() == 2 and logits.numel() > 0
            and logits.stride(-1) == 1 and runs_on(logits.device))


def runs_on(device: torch.device) -> bool:
    """Whether these kernels serve tensors on ``device`` and ran there once, forward and backward."""
    return serves(device) and _probe(str(device), interpreted())


def serves_models_on(device: torch.device) -> bool:
    """Whether a fused model on ``device`` computes its loss here (so it needs no compile)."""
    return enabled and runs_on(device)


@functools.lru_cache(maxsize=None)
def _probe(device: str, interpreted: bool) -> bool:
    """Both kernels once on tiny tensors, once per device and process (:func:`triton_support.probe`)."""
    def check(at: torch.device) -> None:
        for dtype in (torch.float32, torch.bfloat16):  # a width that is a multiple of 16, as a vocabulary's
            logits = torch.zeros(3, 64, device=at, dtype=dtype, requires_grad=True)
            cross_entropy(logits, torch.arange(3, device=at), None).sum().backward()

    return probe("cross-entropy kernels", device, check, "the loss runs compiled by Inductor")


def _kernels():
    from mnb.megatron import loss_triton

    return loss_triton.cross_entropy_forward_kernel, loss_triton.cross_entropy_backward_kernel


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group):
        tokens, width = logits.shape
        tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        start = width * torch.distributed.get_rank(tp_group) if tp > 1 else 0
        target = target.contiguous()
        top, total, picked = (torch.empty(tokens, dtype=torch.float32, device=logits.device) for _ in range(3))
        _kernels()[0][(tokens,)](logits, target, top, total, picked, logits.stride(0), width, start,
                                 BLOCK=BLOCK, num_warps=WARPS)
        calls["forward"] += 1
        here = (target >= start) & (target < start + width)  # a target outside every part counts 0, as Megatron's
        if tp > 1:  # the ranks' parts combined: the global max, each sum rescaled to it, the target's logit
            local_top = top.clone()
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=tp_group)
            both = torch.stack((total * torch.exp(local_top - top), torch.where(here, picked - top, 0.0)))
            torch.distributed.all_reduce(both, group=tp_group)
            total, predicted = both[0].clone(), both[1]  # the sum kept for backward, not the pair's buffer
        else:
            predicted = torch.where(here, picked - top, 0.0)
        ctx.start = start
        ctx.save_for_backward(logits, target, top, total)
        return torch.log(total) - predicted

    @staticmethod
    @once_differentiable  # first order only, as the compiled loss's
    def backward(ctx, grad_loss):
        logits, target, top, total = ctx.saved_tensors
        tokens, width = logits.shape
        grad = torch.empty((tokens, width), dtype=logits.dtype, device=logits.device)
        _kernels()[1][(tokens, -(-width // BLOCK))](logits, target, top, total, grad_loss.float().contiguous(),
                                                    grad, logits.stride(0), width, ctx.start,
                                                    BLOCK=BLOCK, num_warps=WARPS)
        calls["backward"] += 1
        return grad, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Per-token cross entropy of this tp rank's ``logits [tokens, vocabulary / tp]`` against ``target
    [tokens]`` (ids of the whole vocabulary), over the tp group; fp32 ``[tokens]``, with autograd (where
    :func:`applies`; the caller checks)."""
    return _CrossEntropy.apply(logits, target, tp_group)
