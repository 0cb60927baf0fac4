"""A rank's start: torch, the device, the process group, the hello; Megatron-Core after it.

Kept out of ``mnb/worker/main.py`` (the rank's message loop): what happens between torchrun
starting ``python -m mnb.worker`` and the first message the rank serves.  Megatron-Core's
import begins in a helper thread right after torch's, beside CUDA's and NCCL's (or gloo's)
initialisation, and goes on after the hello with Megatron's default layout
(``mnb/worker/late_start.py``): cells wait for it.  A standby rank (``MNB_STANDBY=1``) imports
torch, says ``standby`` and waits for a signed ``go`` before CUDA or any process group (its
Megatron-Core import goes on meanwhile).  On CUDA ranks, once ready, the fused kernels of
:data:`BACKGROUND_PRESETS` compile in a background thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
from typing import Any

from mnb.protocol import STANDBY_ENV, Message
from mnb.worker.late_start import LateStart
from mnb.worker.quiet_warnings import route_warnings, verbose_warnings

log = logging.getLogger("mnb.worker")


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this rank when its torchrun agent dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def start(rank: Any) -> None:
    """Torch, the device, the process group and the pre-bound names; then hello.

    Megatron-Core's import (on CPU ranks with the CPU redirection) begins in a helper thread right
    after torch's and goes on after the hello, followed there by Megatron's default layout
    (:class:`~mnb.worker.late_start.LateStart`): the pool is ready once every rank said hello, and a
    cell that arrives before the rest is done waits for it and says so.
    """
    clock = rank.clock
    verbose = verbose_warnings()
    route_warnings(rank.rank, verbose)
    with clock.stage("torch import"):
        import torch
        import torch.distributed as dist

    if rank.device_kind == "cuda":
        # Megatron-Core's import is seconds of Python; CUDA's and NCCL's initialisation are
        # seconds in C: one overlaps the other, and both overlap the notebook's first seconds.
        rank.late = LateStart(rank, _import_megatron, "Megatron-Core import")
    else:
        def cpu_ranks_import() -> None:
            from mnb.megatron import cpu

            cpu.install()  # imports Megatron-Core's parts with CUDA call sites (the rest: as cells need it)
            route_warnings(rank.rank, verbose)  # cpu.install() ignores the apex notices: log or show them

        rank.late = LateStart(rank, cpu_ranks_import, "Megatron-Core import and CPU redirection")
    if os.environ.get(STANDBY_ENV) == "1":
        stand_by(rank)
    if rank.device_kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch sees no CUDA device on this host")
        with clock.stage("CUDA init"):
            torch.cuda.set_device(rank.local_rank)
        rank.device = torch.device("cuda", rank.local_rank)
        backend = "nccl"
    else:
        from mnb.megatron import collectives

        collectives.install()  # gloo: mnb counts collectives (NCCL ranks have the Flight Recorder)
        rank.device = torch.device("cpu")
        backend = "gloo"
    kwargs: dict[str, Any] = {"backend": backend}
    if backend == "nccl":
        kwargs["device_id"] = rank.device
    with clock.stage(f"process group ({backend})"):
        dist.init_process_group(**kwargs)

    from mnb.config import ParallelConfig
    from mnb.megatron import events

    events.set_sink(rank.send_event)

    import mnb

    rank.namespace.update(
        rank=rank.rank,
        world_size=rank.world_size,
        local_rank=rank.local_rank,
        device=rank.device,
        torch=torch,
        dist=dist,
        mnb=mnb,
        display=rank.display,
    )  # ps: once Megatron-Core is imported (LateStart)
    if rank.device.type == "cuda":
        device = rank.device
        rank.late.after_ready(lambda: _warm_fused_kernels_in_background(device))
    rank.late.send_hello(
        Message(
            "hello",
            header={
                "rank": rank.rank,
                "world_size": rank.world_size,
                "local_rank": rank.local_rank,
                "node_rank": rank.node_rank,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "device": str(rank.device),
                "device_name": _device_name(rank),
                "backend": backend,
                # the default layout's, which the rank builds once Megatron-Core is imported
                "coords": ParallelConfig().resolve(rank.world_size).coordinates(rank.rank),
                "layout": rank.layout,
                "torch": torch.__version__,
                "megatron": _megatron_version(),
                "startup": clock.as_header(),
            },
        )
    )


def stand_by(rank: Any) -> None:
    """A standby rank: torch imported (Megatron-Core importing beside), then wait for ``go`` before CUDA
    or any process group.

    The controller launched this rank ahead of need (``mnb/controller/standby.py``); until
    ``go`` it holds host memory only.  The channel's I/O thread watches the controller
    as for any rank, so a standby whose kernel died exits on its own.
    """
    rank.channel.send(Message("standby", header={"rank": rank.rank, "pid": os.getpid(),
                                                 "host": socket.gethostname()}))
    with rank.clock.stage("standby: waiting for go"):
        while True:
            try:
                message = rank.channel.inbox.get()
            except KeyboardInterrupt:
                continue
            if message.type == "go":
                break
            if message.type == "shutdown":
                rank.channel.close()
                os._exit(0)


def _device_name(rank: Any) -> str:
    import torch

    if rank.device.type == "cuda":
        return torch.cuda.get_device_name(rank.device)
    return "cpu"


def _import_megatron() -> None:
    """Import what the first ``mnb.gpt``/``mnb.train`` needs from Megatron-Core (no CUDA work)."""
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401

    import mnb.megatron.autorecord  # noqa: F401
    import mnb.megatron.layout  # noqa: F401
    import mnb.megatron.model  # noqa: F401
    import mnb.megatron.train  # noqa: F401


BACKGROUND_PRESETS = ("llama-1b", "llama-3b")
"""Presets whose fused kernels a CUDA rank compiles in the background once it is ready."""


def _warm_fused_kernels_in_background(device) -> None:
    """Build the fused kernels of mnb's GPU presets while the notebook has nothing for this rank yet.

    mnb's own Triton kernels (norms, loss, RoPE, SwiGLU) are probed at the presets' widths, which builds
    them (Triton compiles each once per machine and keeps it on disk); whatever they do not run is compiled
    by Inductor (about 11 s with an empty cache on an H200).  The first ``mnb.gpt`` that arrives meanwhile
    waits for this instead of starting its own (the probe's lock, ``fusions.warm_up``'s lock) and then builds
    only what its own shapes still lack.
    """
    import threading

    def warm() -> None:
        try:
            import torch

            from mnb.megatron import fusions

            if not fusions.compile_available():
                return
            from mnb.config import load_preset
            from mnb.megatron import norm_kernels
            from mnb.megatron.model import fused_shapes

            torch.cuda.set_device(device)  # the current device is per thread
            for preset in BACKGROUND_PRESETS:
                norm_kernels.runs_on(device, load_preset(preset).hidden_size)
                fusions.warm_up(device, announce=False, **fused_shapes(load_preset(preset), fusions.tp_ceiling(),
                                                                        swiglu=True, device=device))
        except Exception as exc:  # the first model compiles them instead; say why in the log
            log.warning("background compile of the fused kernels failed: %s", exc)

    threading.Thread(target=warm, name="mnb-fused-kernels", daemon=True).start()


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:  # e.g. Megatron-LM on PYTHONPATH instead of the wheel
        return "unknown"
