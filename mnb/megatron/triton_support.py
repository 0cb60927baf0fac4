"""Where mnb's own Triton kernels can run: one rule for the decode kernels and the norm kernels.

Torch's CUDA wheels bring Triton; its CPU wheels do not.  ``TRITON_INTERPRET=1`` in a process's
environment from its start runs Triton kernels on CPU tensors, slowly: how the tests run them.
Whether a kernel also builds here (Triton imports without a C compiler or a supported GPU, then fails
to build) is each kernel module's own probe.
"""

from __future__ import annotations

import functools
import os

import torch


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
