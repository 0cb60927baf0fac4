"""A fused model's first steps never wait for the compiler: they run unfused while it works.

Why: ``torch.compile`` of the fused loss, RoPE and SwiGLU (:mod:`mnb.megatron.fusions`) takes
seconds (about 11 s with an empty Inductor cache on an H200), and a fresh pool's first llama-1b
step waited for it: 32.6 s against 16.0 s for a cold ``torchrun`` of Megatron's own ops
(BENCHMARKS.md).  Now ``mnb.gpt`` starts the compile in a background thread (:func:`start`) and
returns; until every kernel of the model is compiled, the fused ops run their eager version
(the same arithmetic, op by op: ``fusions.run_eager``).  ``mnb.train`` switches to the compiled
kernels at a step boundary, the same step on every rank: each rank's readiness rides along in
the all-reduce that already agrees on the loss and the interrupt flag (:class:`Steps`), and each
step's row says whether it ran unfused (``compiling``), so the summary can say "steps 1–3 unfused
while compiling" and at what memory.  The unfused ops keep to the fused path's memory (they work by
blocks of rows: :func:`mnb.megatron.fusions.by_rows`); a step that would still not fit unfused,
measured on the step before it, waits for the kernels instead and says so (:class:`Steps`).

Compiling in a thread beside training is safe in torch 2.x: Dynamo's frame hook is per thread
(the main thread's eager ops are never traced), compiles are serialised by Dynamo's own
``compile_lock`` and one warm-up runs at a time (``fusions._warm_lock``; the pool's own
background compile of the GPU presets, ``mnb/worker/boot.py``, counts: a model whose kernels it
compiled switches as soon as they are there).  The warm-up's tensors are private (its own
generator, its own autograd graph); its kernels share the training's CUDA stream, so they only
delay it a little.  Outside ``mnb.train`` (``mnb.logits``, ``mnb.generate``) each call uses the
compiled kernels once this rank has them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from mnb.megatron import fusions

log = logging.getLogger(__name__)


class Compile:
    """One background compile of a model's kernels (``fusions.warm_up`` in a daemon thread)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, shapes: dict[str, Any]):
        self.keys = fusions.warm_keys(dtype, **shapes)
        self.error: str | None = None
        self.took_s: float | None = None
        self._device, self._dtype, self._shapes = device, dtype, shapes
        self._began = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="mnb-compile-fused", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)  # the current device is per thread
            fusions.warm_up(self._device, self._dtype, announce=False, **self._shapes)
            self.took_s = time.perf_counter() - self._began
        except Exception as exc:  # the ops stay eager (same arithmetic); the rank's log says why
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("compiling the fused kernels failed; they run unfused: %s", self.error)

    @property
    def ready(self) -> bool:
        return fusions.is_warm(self.keys)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the compile to end (tests, benchmarks); whether the kernels are ready."""
        self._thread.join(timeout_s)
        return self.ready


_pending: Compile | None = None
"""The compile the last fused model started (None: nothing compiles, or it finished)."""
_decision: bool | None = None
"""Inside ``mnb.train``: whether this step runs compiled (agreed by every rank); None outside."""


def _run_eager() -> bool:
    if _decision is not None:
        return not _decision
    return not local_ready()


def local_ready() -> bool:
    """Whether this rank has every kernel of the last fused model compiled."""
    pending = _pending
    return pending is None or pending.ready


def start(device: torch.device, shapes: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> Compile | None:
    """Compile a new fused model's kernels in the background (None: they are all compiled already)."""
    global _pending
    keys = fusions.warm_keys(dtype, **shapes)
    if fusions.is_warm(keys):
        return None
    pending = _pending
    if pending is None or pending.keys != keys or pending.error is not None or not pending._thread.is_alive():
        pending = Compile(device, dtype, shapes)
    _pending = pending
    fusions.run_eager = _run_eager
    return pending


def pending() -> Compile | None:
    """The compile under way or unfinished, if any (``wait()`` on it in tests and benchmarks)."""
    return _pending


FIT_FRACTION = 0.95
"""A step runs unfused only while what it would need stays under this share of the GPU's memory."""


def unfused_need_bytes(step_peak_bytes: int, start_bytes: int, end_bytes: int) -> int:
    """What the next unfused step needs, measured on the one just run unfused: its peak, plus what it
    left allocated beyond what it began with (Adam's moments, made at the first step, are there for
    every later step)."""
    return step_peak_bytes + max(0, end_bytes - start_bytes)


class Steps:
    """``mnb.train``'s view: decide at each step boundary whether the next step runs compiled.

    ``votes()`` is this rank's part of the all-reduce the step boundary already does: whether its
    kernels are still compiling, and whether the next step, unfused, would not fit on its GPU
    (:func:`unfused_need_bytes` against :data:`FIT_FRACTION` of the device's memory: measured by the
    allocator on the step just run unfused).  ``decide(not_ready, tight)`` applies the sums: every rank
    switches at once, and when some rank would not fit, every rank waits for its kernels (and says so)
    rather than run a step unfused.  The unfused ops are lean (the eager loss and SwiGLU work by
    blocks: :func:`mnb.megatron.fusions.by_rows`), so this wait is for models at the edge of memory.
    """

    def __init__(self, fused: bool, device: torch.device | None = None, keys: tuple = ()):
        self.fused = fused
        self.keys = keys
        """The model's compiled kernels (``MegatronModel.compile_keys``): its steps wait on these and no other
        model's compile (a model whose fused ops all run in mnb's own kernels has none)."""
        self.compiled = True
        """Whether the current step runs the compiled kernels (always True for an unfused model)."""
        self.waited_s: float | None = None
        """Seconds the last boundary waited for the kernels (None: it did not wait)."""
        self._device = device
        self._start_bytes: int | None = None

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *exc: Any) -> None:
        global _decision
        _decision = None

    def _ready(self) -> bool:
        """Whether this rank has every kernel the model needs compiled."""
        return fusions.is_warm(self.keys)

    def _measures(self) -> bool:
        return self.fused and self._device is not None and self._device.type == "cuda"

    def begin_step(self) -> None:
        """At a step's start (after the allocator's peak is reset): what is allocated now."""
        self._start_bytes = (torch.cuda.memory_allocated(self._device)
                             if self._measures() and not self.compiled else None)

    def unfused_need(self) -> tuple[int, int] | None:
        """(bytes the next step needs unfused, the GPU's bytes), measured on the step just run unfused;
        None before the first step, after a compiled step, and on CPU ranks."""
        if self._start_bytes is None or not self._measures():
            return None
        need = unfused_need_bytes(torch.cuda.max_memory_allocated(self._device), self._start_bytes,
                                  torch.cuda.memory_allocated(self._device))
        return need, int(torch.cuda.get_device_properties(self._device).total_memory)

    def votes(self) -> tuple[float, float]:
        """(1.0 if this rank's kernels are still compiling, 1.0 if the next step unfused would not fit)."""
        if not self.fused or self._ready():
            return 0.0, 0.0
        measured = self.unfused_need()
        tight = measured is not None and measured[0] > FIT_FRACTION * measured[1]
        if tight:
            from mnb.units import format_bytes

            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            print(f"mnb: rank {rank}: the next step, unfused, would need {format_bytes(measured[0])} of "
                  f"{format_bytes(measured[1])} (the last step's peak and what it kept): waiting for the fused "
                  "kernels to compile instead", flush=True)
        return 1.0, 1.0 if tight else 0.0

    def decide(self, not_ready: float, tight: float = 0.0) -> None:
        """Apply the summed votes (the same on every rank, so every rank takes the same branch)."""
        global _decision, _pending
        if not self.fused:
            return
        self.waited_s = None
        if not_ready and tight:
            began = time.perf_counter()
            pending = _pending
            if pending is not None:
                pending.wait()
            self.waited_s = time.perf_counter() - began
            device = self._device or torch.device("cpu")
            again = torch.tensor([0.0 if self._ready() else 1.0], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(again)  # a compile that failed somewhere leaves that rank unfused
            not_ready = float(again[0])
        self.compiled = not_ready == 0
        _decision = self.compiled
        if self.compiled and _pending is not None and _pending.ready:
            _pending = None  # every rank has them: nothing is pending any more
