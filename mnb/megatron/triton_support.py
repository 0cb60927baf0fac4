"""Where mnb's own Triton kernels can run: one rule for the decode kernels and the norm kernels.

Torch's CUDA wheels bring Triton; its CPU wheels do not.  ``TRITON_INTERPRET=1`` in a process's
environment from its start runs Triton kernels on CPU tensors, slowly: how the tests run them.
Whether a kernel also builds here (Triton imports without a C compiler or a supported GPU, then fails
to build) is each kernel module's own probe.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Callable

import torch

log = logging.getLogger(__name__)
_probing = threading.Lock()
"""One probe at a time: the pool's background compile thread and a model's build can probe together."""


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether Triton imports here."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import: torch's ops serve
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors) in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def serves(device: torch.device) -> bool:
    """Whether Triton kernels can take tensors on ``device``: CUDA with Triton, or any device under the
    interpreter."""
    return available() and (device.type == "cuda" or interpreted())


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def by_pointer(*tensors: torch.Tensor) -> bool:
    """Whether a kernel can take these by pointer: plain tensors (a DTensor, Megatron-FSDP's sharded weights,
    or another subclass goes to torch's ops) of a float dtype mnb's kernels compute in."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype in FLOATS for t in tensors)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, width]`` with contiguous rows (a copy only when its last dimension is strided or its
    rows cannot be flattened without one): what mnb's row kernels take, with the rows' stride."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def probe(what: str, device: str, check: Callable[[torch.device], object], instead: str) -> bool:
    """Whether ``check(device)`` (a kernel module's kernels on tiny tensors, in each dtype training uses) ran;
    False, with a warning that names ``what`` and what serves ``instead``, if it raised.  Each module caches
    its answer per device; probes run one at a time.

    A first use may come inside a forward, so the check sets its own autograd state: grad on whatever the
    caller's mode (``mnb.generate``, ``mnb.evaluate`` and Megatron's recompute run under ``torch.no_grad()``,
    and backward kernels are probed too) and saved tensors kept as they are (the caller's saved-tensor hooks,
    e.g. non-reentrant checkpointing or mnb's activation meter, must not see the probe's tensors)."""
    try:
        at = torch.device(device)
        keep = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with _probing, torch.inference_mode(False), torch.enable_grad(), keep:
            check(at)
        if at.type == "cuda":
            torch.cuda.synchronize(at)
        return True
    except Exception as error:  # noqa: BLE001 - any failure: torch's ops serve instead
        log.warning("mnb's %s do not run on %s (%s: %s); %s", what, device, type(error).__name__, error, instead)
        return False
