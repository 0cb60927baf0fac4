"""A standby begun at ``%load_ext mnb`` on GPU machines, so the first ``%mnb start`` is ready sooner.

The first ``%mnb start`` of a kernel pays torchrun's agent, the torch import and the
Megatron-Core import (14 s on an H200, BENCHMARKS.md) unless ranks were launched ahead.  On
a machine with GPUs, ``%load_ext mnb`` launches a standby (:mod:`mnb.controller.standby`) for
the pool that a bare ``%mnb start`` builds (every visible GPU, ``--device auto``, ``--ip
127.0.0.1``, no ``--threads``/``--verbose``, the kernel's environment) and parks it; the first
``%mnb start`` adopts it when its settings match and discards it otherwise (the start line says
which), exactly like the standby a ``%mnb stop`` leaves.  Its ranks watch the kernel and the
kernel's exit ends them, as for every standby.

``MNB_STANDBY_AT_LOAD``: unset or ``auto``: only when the machine shows NVIDIA GPUs (a
directory listing of ``/proc/driver/nvidia/gpus`` or an ``nvidia-smi`` on PATH, both without
torch; the GPU count then comes from nvidia-smi in a background thread); ``0``: never;
``1``: also on machines without GPUs (a CPU pool's defaults: 2 ranks; tests use it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from mnb.controller import standby as standbys
from mnb.controller.machine import resolve_device
from mnb.controller.pool import launch_spec, make_launcher
from mnb.timeouts import START_TIMEOUT_S

AT_LOAD_ENV = "MNB_STANDBY_AT_LOAD"
VALUES = ("auto", "0", "1")
DEFAULT_BIND_IP = "127.0.0.1"
"""``%mnb start``'s default ``--ip``."""
NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


def machine_shows_gpus() -> bool:
    """Whether NVIDIA GPUs are likely here, in microseconds and without torch (no subprocess)."""
    try:
        if any(NVIDIA_PROC.iterdir()):
            return True
    except OSError:
        pass
    return shutil.which("nvidia-smi") is not None


def wanted() -> str:
    """``MNB_STANDBY_AT_LOAD`` checked: ``auto``, ``0`` or ``1`` (an unknown value is refused)."""
    value = os.environ.get(AT_LOAD_ENV, "auto").strip().lower() or "auto"
    if value not in VALUES:
        raise ValueError(f"{AT_LOAD_ENV}={value!r}: use auto (GPU machines), 0 (never) or 1 (also CPU machines)")
    return value


def begin(*, pool_running: bool) -> bool:
    """Begin the load-time standby when wanted and useful; whether one is being made.

    Nothing when a pool already runs or a standby is already parked (``%load_ext mnb`` again).
    """
    mode = wanted()
    if mode == "0" or pool_running or standbys.parked_status() is not None:
        return False
    if mode == "auto" and not machine_shows_gpus():
        return False
    standbys.park_when_made(lambda: _make(cpu_too=mode == "1"))
    return True


def _make(*, cpu_too: bool) -> "standbys.Standby | None":
    """The standby of a bare ``%mnb start``'s pool (None: a CPU machine and ``auto``)."""
    device, nproc = resolve_device("auto", None, None)  # nvidia-smi: the GPU count, as %mnb start sees it
    if device != "cuda" and not cpu_too:
        return None
    unused = Path(tempfile.gettempdir()) / "mnb-standby-at-load"  # the standby keeps its files in its own folder
    spec = launch_spec(nproc, device, unused, bind_ip=DEFAULT_BIND_IP)
    return standbys.Standby(spec, DEFAULT_BIND_IP, make_launcher, START_TIMEOUT_S)
