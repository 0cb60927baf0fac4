"""What this machine can hold: the GPUs the ranks would see and how many CPU ranks fit.

Checked by ``Pool.start`` (and the standby begun at ``%load_ext mnb``) before anything is
launched, without importing torch in the kernel: GPUs are counted with nvidia-smi,
CPU ranks bounded by cores and free memory.  The process tree is :mod:`mnb.controller.launcher`'s.
"""

from __future__ import annotations

import os
import subprocess

import psutil

from mnb.units import GIB, MIB


def visible_gpu_count() -> int:
    """GPUs the workers would see, without importing torch in the kernel."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        physical = len([line for line in out.stdout.splitlines() if line.strip()]) if out.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired):
        physical = 0
    if env is not None and physical:
        ids = [x for x in env.split(",") if x.strip() and x.strip() != "-1"]
        return min(len(ids), physical)
    return physical


def resolve_device(device: str, nproc: int | None, gpus: list[int] | None) -> tuple[str, int]:
    """Check --device/-n/--gpus against what this machine has; return (device, nproc)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
    if nproc is not None and nproc < 1:
        raise ValueError(f"-n must be at least 1, got {nproc}")
    visible = visible_gpu_count() if (device != "cpu" or gpus) else 0
    if gpus is not None:
        if device == "cpu":
            raise ValueError("--gpus was given with --device cpu; drop one of them")
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"--gpus lists a GPU twice: {gpus}")
        unknown = [g for g in gpus if g < 0 or g >= visible]
        if unknown:
            raise ValueError(
                f"unknown GPU id(s) {unknown}: this machine shows {visible} GPU(s)"
                + (f" (ids 0-{visible - 1})" if visible else "")
            )
        device = "cuda"
        if nproc is None:
            nproc = len(gpus)
        elif nproc != len(gpus):
            raise ValueError(f"-n {nproc} does not match the {len(gpus)} GPU(s) given by --gpus {gpus}")
        return device, nproc
    if device == "auto":
        device = "cuda" if visible else "cpu"
    if device == "cuda":
        if not visible:
            raise ValueError("--device cuda but no GPU is visible here (nvidia-smi found none); use --device cpu")
        nproc = visible if nproc is None else nproc
        if nproc > visible:
            raise ValueError(f"-n {nproc} is larger than the {visible} visible GPU(s); use -n {visible} or fewer")
        return device, nproc
    nproc = 2 if nproc is None else nproc
    limit, why = cpu_rank_limit()
    if nproc > limit:
        raise ValueError(f"-n {nproc} is more CPU ranks than this machine can hold: {why}; use -n {limit} or fewer")
    return "cpu", nproc


MAX_CPU_RANKS_PER_CORE = 4
"""Beyond this, CPU ranks spend their time switching and gloo's collectives time out."""
CPU_RANK_BYTES = 600 * MIB
"""What one CPU rank holds once torch and Megatron-Core are imported (measured 0.5-0.7 GiB)."""


def cpu_rank_limit() -> tuple[int, str]:
    """How many CPU ranks this machine can hold, and why: cores and free memory."""
    cores = os.cpu_count() or 1
    free = psutil.virtual_memory().available
    by_cores, by_memory = cores * MAX_CPU_RANKS_PER_CORE, max(1, free // CPU_RANK_BYTES)
    why = (f"{cores} core(s) take at most {by_cores} ranks ({MAX_CPU_RANKS_PER_CORE} per core), "
           f"{free / GIB:.1f} GiB of free memory about {by_memory} ({CPU_RANK_BYTES / GIB:.1f} GiB each)")
    return min(by_cores, by_memory), why
