"""A rank's start: torch, the device, the process group, Megatron's default layout, the hello.

Kept out of ``mnb/worker/main.py`` (the rank's message loop): what happens between torchrun
starting ``python -m mnb.worker`` and the first message the rank serves.  A standby rank
(``MNB_STANDBY=1``) imports torch and Megatron-Core, then waits for a signed ``go`` before
CUDA or any process group.  On CUDA ranks Megatron-Core is imported in a helper thread
beside CUDA's and NCCL's initialisation, and once ready the fused kernels of
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
from mnb.worker.quiet_warnings import route_warnings, verbose_warnings
from mnb.worker.startup import StartClock

log = logging.getLogger("mnb.worker")


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this rank when its torchrun agent dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def start(rank: Any) -> None:
    """Torch, the device, the process group, Megatron's default layout and the pre-bound names; then hello."""
    clock = rank.clock
    verbose = verbose_warnings()
    route_warnings(rank.rank, verbose)
    with clock.stage("torch import"):
        import torch
        import torch.distributed as dist

    if os.environ.get(STANDBY_ENV) == "1":
        stand_by(rank)
    megatron_import = None
    if rank.device_kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch sees no CUDA device on this host")
        # Megatron-Core's import is seconds of Python; CUDA's and NCCL's initialisation are
        # seconds in C: one overlaps the other.
        megatron_import = _InThread("Megatron-Core import", clock, _import_megatron)
        with clock.stage("CUDA init"):
            torch.cuda.set_device(rank.local_rank)
        rank.device = torch.device("cuda", rank.local_rank)
        backend = "nccl"
    else:
        from mnb.megatron import cpu

        with clock.stage("Megatron-Core import and CPU redirection"):
            cpu.install()
        route_warnings(rank.rank, verbose)  # cpu.install() ignores the apex notices: log or show them
        from mnb.megatron import collectives

        collectives.install()  # gloo: mnb counts collectives (NCCL ranks have the Flight Recorder)
        rank.device = torch.device("cpu")
        backend = "gloo"
    kwargs: dict[str, Any] = {"backend": backend}
    if backend == "nccl":
        kwargs["device_id"] = rank.device
    with clock.stage(f"process group ({backend})"):
        dist.init_process_group(**kwargs)
    if megatron_import is not None:
        megatron_import.result()

    with clock.stage("mnb: layout and recording"):
        from megatron.core import parallel_state

        from mnb.config import ParallelConfig
        from mnb.megatron import autorecord, events, layout

        layout.apply_layout(ParallelConfig())
        autorecord.install()  # a cell's or script's own get_forward_backward_func calls are measured
    events.set_sink(rank.send_event)

    import mnb

    rank.namespace.update(
        rank=rank.rank,
        world_size=rank.world_size,
        local_rank=rank.local_rank,
        device=rank.device,
        torch=torch,
        dist=dist,
        ps=parallel_state,
        mnb=mnb,
        display=rank.display,
    )
    rank.channel.send(
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
                "coords": layout.coordinates(),
                "layout": rank.layout,
                "torch": torch.__version__,
                "megatron": _megatron_version(),
                "startup": clock.as_header(),
            },
        )
    )
    if rank.device.type == "cuda":
        _warm_fused_kernels_in_background(rank.device)


def stand_by(rank: Any) -> None:
    """A standby rank: Megatron-Core imported, then wait for ``go`` before CUDA or any process group.

    The controller launched this rank ahead of need (``mnb/controller/standby.py``); until
    ``go`` it holds host memory only.  The channel's I/O thread watches the controller
    as for any rank, so a standby whose kernel died exits on its own.
    """
    with rank.clock.stage("standby: Megatron-Core import"):
        if rank.device_kind == "cuda":
            _import_megatron()  # pure Python: no CUDA call
        else:
            from mnb.megatron import cpu

            cpu.install()
            _import_megatron()  # what the first model needs, ahead of the go
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


class _InThread:
    """Run ``fn`` in a helper thread as one stage of the start; :meth:`result` re-raises its error."""

    def __init__(self, name: str, clock: StartClock, fn):
        import threading

        self._error: BaseException | None = None

        def run() -> None:
            try:
                with clock.stage(name):
                    fn()
            except BaseException as exc:  # re-raised in the main thread by result()
                self._error = exc

        self._thread = threading.Thread(target=run, name=f"mnb-{name}", daemon=True)
        self._thread.start()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


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
    """Compile the fused kernels of mnb's GPU presets while the notebook has nothing for this rank yet.

    They take seconds to compile (about 11 s with an empty Inductor cache on an H200); the
    first ``mnb.gpt`` that arrives meanwhile waits for this compile instead of starting its own
    (``fusions.warm_up`` holds a lock) and then compiles only what its own shapes still lack.
    """
    import threading

    def warm() -> None:
        try:
            import torch

            from mnb.megatron import fusions

            if not fusions.compile_available():
                return
            from mnb.config import load_preset
            from mnb.megatron.model import fused_shapes

            torch.cuda.set_device(device)  # the current device is per thread
            for preset in BACKGROUND_PRESETS:
                fusions.warm_up(device, announce=False,
                                **fused_shapes(load_preset(preset), fusions.tp_ceiling(), swiglu=True))
        except Exception as exc:  # the first model compiles them instead; say why in the log
            log.warning("background compile of the fused kernels failed: %s", exc)

    threading.Thread(target=warm, name="mnb-fused-kernels", daemon=True).start()


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:  # e.g. Megatron-LM on PYTHONPATH instead of the wheel
        return "unknown"
