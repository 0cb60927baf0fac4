"""Delayed scaling for FP8 casts (``fp8="delayed"``): the scale of a tensor from the amaxes of the last
:data:`HISTORY` tensors of its kind, so that its cast reads it once.

Why: with current scaling (``"tensorwise"``) every cast is two passes over the bf16 tensor, one only to
find its amax and one to cast it; on an H200 the amax passes took 0.10 s of a 4.5 s llama-3b FP8 step and,
with the casts' launches, most of what the FP8 GEMMs save (BENCHMARKS.md, 2026-12-05).  Transformer
Engine's default recipe (``DelayedScaling``) takes the scale from an amax history instead, and records the
tensor's own amax while it casts it.  Here one Triton kernel (:mod:`mnb.megatron.fp8_triton`) does that for
an activation or a gradient ``[tokens, width]``: it reads the history, casts row by row and/or into the
transposed layout a weight-gradient GEMM takes, and leaves the tensor's amax for the next call.

Each linear keeps two histories (:class:`AmaxHistory`): its inputs and its output gradients.  A history
holds the last call's amax as one entry per kernel program (every program writes its own, so nothing is
cleared between calls: two blocks used in turn) and the calls before it as one value each, in ``HISTORY``
slots: a call reads all but the oldest, and its program 0 writes the last call's amax over the oldest.  The scale is ``fmax / max(history)``, TE's
``amax_compute_algo="max"``; a value beyond it saturates at the format's largest (as in TE).  A history's
first call, with nothing recorded, takes the tensor's own amax first (one extra pass, once).

Used by :class:`mnb.megatron.fp8.FP8Linear` inside a training step; outside one (``mnb.evaluate``,
``mnb.generate``) the linears scale each tensor by its own amax, so results do not depend on what ran
before.  Where the kernel does not run (no Triton, a failed probe) the same arithmetic runs as torch ops.
"""

from __future__ import annotations

import functools

import torch

from mnb.config import FP8_AMAX_HISTORY
from mnb.megatron.triton_support import interpreted, next_power_of_two, probe, serves

HISTORY = FP8_AMAX_HISTORY
"""Casts whose amaxes set the next scale (:data:`mnb.config.FP8_AMAX_HISTORY`, the one statement of it)."""
enabled = True
"""Off: the delayed casts run as torch ops (the same arithmetic and history; benchmarks and tests compare)."""
BLOCK_T, BLOCK_K = 64, 64
"""A program's tile: tokens x columns (the transposed store goes through shared memory)."""
PROGRAMS_PER_SM = 4
calls = {"kernel": 0, "torch": 0}
"""Casts in this process, by which path served them (tests and diagnostics)."""


class AmaxHistory:
    """The amaxes of one kind of tensor of one linear (its inputs, or its output gradients): the state of
    its delayed scaling.  Lives on the device of the first tensor cast; never part of a checkpoint (a
    model built again, or loaded, starts a new history with its first tensor's own amax)."""

    def __init__(self, length: int = HISTORY):
        if length < 1:
            raise ValueError(f"an amax history needs at least one entry, got {length}")
        self.length = length
        self.calls = 0
        self.state: torch.Tensor | None = None
        self.programs = 0

    def positions(self) -> tuple[int, int, int]:
        """``(last, current, slot)`` of this call: the block holding the last call's per-program amaxes, the
        block this call writes, and the slot the last call's amax is folded into."""
        k = self.calls
        return (k + 1) % 2, k % 2, (k - 1) % self.length

    def prepare(self, x: torch.Tensor) -> None:
        """Allocate the state on ``x``'s device, with ``x``'s own amax as the last call's (the first call)."""
        if self.state is not None and self.state.device == x.device:
            return
        self.programs = programs_on(str(x.device))
        self.state = torch.zeros(2 * self.programs + self.length, dtype=torch.float32, device=x.device)
        self.calls = 0
        last = self.positions()[0]
        self.state[last * self.programs] = x.detach().abs().amax().float()

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(last call's amax, the amax the next scale comes from)`` as the kernel reads them, on the device: the
        last call's per-program maxima, and every slot but the oldest (the one the next call writes over)."""
        last, _, slot = self.positions()
        p = self.programs
        newest = self.state[last * p:(last + 1) * p].max()
        older = self.state[2 * p:2 * p + self.length].clone()
        older[slot] = 0.0
        return newest, torch.maximum(newest, older.max())

    def amax(self) -> float:
        """The amax the next call's scale comes from (a host read: tests and diagnostics)."""
        return 0.0 if self.state is None else float(self.read()[1])


def programs_on(device: str) -> int:
    """Kernel programs a cast runs on ``device`` (a power of two, the history's block size)."""
    at = torch.device(device)
    if at.type != "cuda":
        return 4  # the interpreter, or torch's ops on CPU: a few blocks
    sms = torch.cuda.get_device_properties(at).multi_processor_count
    return 1 << (PROGRAMS_PER_SM * sms).bit_length() - 1


def cast(x: torch.Tensor, dtype: torch.dtype, history: AmaxHistory, *, rows: bool = True,
         transposed: bool = False):
    """``(data, data_t, scale)`` of ``x [tokens, width]`` with the scale from ``history``, which records
    ``x``'s amax: the fp8 data row by row (``rows``, else None) and its transpose laid out row by row
    (``transposed``, else None), ``data = saturate(x * scale)``; ``scale`` a 0-d fp32 tensor (``_scaled_mm``
    takes its inverse)."""
    if x.dim() != 2:
        raise ValueError(f"a delayed-scaling cast takes [tokens, width], got {tuple(x.shape)}")
    history.prepare(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if runs_on(x.device):
        out = _cast_kernel(x, dtype, history, rows, transposed)
    else:
        out = _cast_torch(x, dtype, history, rows, transposed)
    history.calls += 1
    return out


def _cast_torch(x: torch.Tensor, dtype: torch.dtype, history: AmaxHistory, rows: bool, transposed: bool):
    """The kernel's arithmetic and history update as torch ops (where the kernel does not run)."""
    fmax = torch.finfo(dtype).max
    state, p = history.state, history.programs
    _, current, slot = history.positions()
    newest, amax = history.read()
    state[2 * p + slot] = newest  # over the oldest slot, which the read left out
    scale = torch.tensor(fmax, dtype=torch.float32, device=x.device) / amax.clamp(min=1e-12)
    state[current * p:(current + 1) * p] = 0.0
    state[current * p] = x.abs().amax().float()
    data = (x.float() * scale).clamp(-fmax, fmax).to(dtype)
    calls["torch"] += 1
    return data if rows else None, data.t().contiguous() if transposed else None, scale


def _cast_kernel(x: torch.Tensor, dtype: torch.dtype, history: AmaxHistory, rows: bool, transposed: bool):
    from mnb.megatron.fp8_triton import delayed_cast_kernel

    tokens, width = x.shape
    data = torch.empty(tokens, width, dtype=dtype, device=x.device) if rows else None
    data_t = torch.empty(width, tokens, dtype=dtype, device=x.device) if transposed else None
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    last, current, slot = history.positions()
    slots = history.length
    some = data if data is not None else data_t
    delayed_cast_kernel[(history.programs,)](
        x, data if data is not None else some, data_t if data_t is not None else some, history.state, scale,
        tokens, width, x.stride(0), last, current, slot, slots, float(torch.finfo(dtype).max),
        PROGRAMS=history.programs, SLOTS=next_power_of_two(slots), BLOCK_T=BLOCK_T,
        BLOCK_K=BLOCK_K, ROWS=rows, TRANSPOSED=transposed, num_warps=4)
    calls["kernel"] += 1
    return data, data_t, scale


def runs_on(device: torch.device) -> bool:
    """Whether the kernel serves tensors on ``device`` (:func:`mnb.megatron.triton_support.serves`) and ran
    once there, on a few tokens in each format."""
    return enabled and serves(device) and _probe(str(device), interpreted())


@functools.lru_cache(maxsize=None)
def _probe(device: str, interpreted: bool) -> bool:
    def check(at: torch.device) -> None:
        x = torch.ones(3, 16, device=at, dtype=torch.bfloat16)
        # what FP8Linear casts: inputs (E4M3) in each pair of layouts, gradients (E5M2) in both
        for dtype, rows, transposed in ((torch.float8_e4m3fn, True, True), (torch.float8_e4m3fn, True, False),
                                        (torch.float8_e4m3fn, False, True), (torch.float8_e5m2, True, True)):
            history = AmaxHistory()
            history.prepare(x)
            _cast_kernel(x, dtype, history, rows, transposed)

    return probe("FP8 delayed-scaling casts", device, check, "they run as torch ops")
