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
while compiling".

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


class Steps:
    """``mnb.train``'s view: decide at each step boundary whether the next step runs compiled.

    ``readiness()`` is this rank's vote (1.0: not ready) for the all-reduce the step boundary
    already does; ``decide(not_ready_sum)`` applies the sum, so every rank switches at once.
    """

    def __init__(self, fused: bool):
        self.fused = fused
        self.compiled = True
        """Whether the current step runs the compiled kernels (always True for an unfused model)."""

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *exc: Any) -> None:
        global _decision
        _decision = None

    def readiness(self) -> float:
        return 0.0 if not self.fused or local_ready() else 1.0

    def decide(self, not_ready: float) -> None:
        global _decision, _pending
        if not self.fused:
            return
        self.compiled = not_ready == 0
        _decision = self.compiled
        if self.compiled and _pending is not None and _pending.ready:
            _pending = None  # every rank has them: nothing is pending any more
