"""``python -m mnb.worker``: one rank of an mnb pool, started by torchrun.

Started by the controller as::

    torchrun --nproc-per-node 2 ... -m mnb.worker --connect /path/pool.json --device cpu

or by hand on another host to join a running pool (the connection file must be
copied there; it holds the pool's secret)::

    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m mnb.worker --connect pool.json --device cuda

The rank initialises torch.distributed (NCCL on GPUs, gloo on CPU, where the
CPU redirection of Megatron's CUDA calls is installed), sets Megatron's
default layout, says hello, and then runs cells until told to shut down.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import re
import signal
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from mnb.worker.startup import StartClock  # first: its import time is when the rank's own code began
from mnb.worker import sandbox  # noqa: F401  (second: it records the rank's original sys.path)
from mnb.protocol import ConnectionInfo, Message
from mnb.worker.capture import FdCapture, RankStream, close_figures, mime_bundle, open_figures
from mnb.worker.channel import Channel
from mnb.worker.executor import describe_exception, portable, release_frames, run_cell
from mnb.worker.faults import record_fatal_stacks
from mnb.worker import stdin

log = logging.getLogger("mnb.worker")

STANDBY_ENV = "MNB_STANDBY"
"""Set to 1 by the controller for a standby generation (``mnb/controller/standby.py``)."""

# Known third-party notices that Megatron-Core and torch raise while importing,
# building models or loading checkpoints, on every rank; they say nothing a
# notebook user can act on (mnb already chose the torch fallbacks).  They go to
# the pool's log (this rank's real stderr, which torchrun writes to
# ``mnb.pool().spec.log_file``), not to the cell; ``%mnb start --verbose``
# (MNB_VERBOSE=1 in the ranks' environment) shows them in the cells.  Every
# other warning reaches the cell's output as usual.  Patterns match the start of
# the message, case-insensitively (as ``warnings.filterwarnings`` does).
QUIET_WARNINGS = (
    # the TE / apex fallback notices (Megatron's optimizer, clip_grads, FSDP, norms)
    r"(Transformer Engine and )?Apex (is|are) not installed",
    r"(MimoModelConfig|MimoModel|ModalitySubmodules) is experimental",
    r"full scope is deprecated",
    # (on CUDA ranks mnb sets CUDA_DEVICE_MAX_CONNECTIONS=1; on CPU ranks it means nothing)
    r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment "
    r"variable CUDA_DEVICE_MAX_CONNECTIONS",
    # torch 2.13 deprecates the collectives Megatron-Core's tensor and sequence parallelism call
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    # torch inside Megatron's dist_checkpointing (mnb.save / mnb.load)
    r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to load in a single process",
    r"`load_state_dict` is deprecated and will be removed",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    # torch's checkpoint API on Megatron 0.19's positional call (mnb.load)
    r"The argument order of (load|save) has been changed",
)


def verbose_warnings() -> bool:
    """Whether ``%mnb start --verbose`` asked for every warning in the cells (``MNB_VERBOSE=1``)."""
    return os.environ.get("MNB_VERBOSE", "").strip().lower() not in ("", "0", "false", "no")


def route_warnings(rank: int, verbose: bool) -> None:
    """Send the known notices (:data:`QUIET_WARNINGS`) to the pool's log, or with ``verbose`` to the cell.

    Each is shown once per place it is raised (Python's "default" action; this
    also undoes the "ignore" filters Megatron's helpers or mnb's CPU mode set).
    Idempotent: call it again after code that adds its own filters.
    """
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("default", message=pattern)
    if verbose or getattr(warnings.showwarning, "_mnb_routed", False):
        return
    quiet = re.compile("|".join(f"(?:{pattern})" for pattern in QUIET_WARNINGS), re.IGNORECASE)
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):  # warnings' signature
        log_file = sys.__stderr__
        if file is not None or log_file is None or not quiet.match(str(message)):
            return show(message, category, filename, lineno, file, line)
        try:
            log_file.write(f"mnb rank {rank} (to the log; %mnb start --verbose shows it in cells): "
                           + warnings.formatwarning(message, category, filename, lineno, line))
            log_file.flush()
        except (OSError, ValueError):  # the log is gone: the rank is ending anyway
            pass
        return None

    showwarning._mnb_routed = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this rank when its torchrun agent dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class Rank:
    """State of this rank: its channel, namespace and current layout."""

    def __init__(self, info: ConnectionInfo, device_kind: str):
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.node_rank = int(os.environ.get("GROUP_RANK", "0"))
        self.device_kind = device_kind
        self.channel = Channel(info, self.rank, status_fn=self.status, deferring_fn=_interrupts_deferred,
                               collectives_fn=_collectives_snapshot)
        self.layout: dict[str, Any] | None = None
        self.namespace: dict[str, Any] = {"__name__": "__mnb__"}
        self.stdout = RankStream("stdout", self.channel, self.rank, sys.__stdout__)
        self.stderr = RankStream("stderr", self.channel, self.rank, sys.__stderr__)
        self.display_here = False
        self.clock = StartClock()
        self.fd_capture = FdCapture(self.channel)
        self.profiles_root = Path(info.path).parent / "profiles" if info.path else None
        """Where ``mnb.train(profile=...)`` writes outside a ``--profile`` cell (the pool's folder)."""
        self.last_failure: BaseException | None = None
        """The last cell's failure with its frames, for ``%mnb debug``; released when the next cell starts."""

    # -------------------------------------------------------------- start
    def start(self) -> None:
        clock = self.clock
        verbose = verbose_warnings()
        route_warnings(self.rank, verbose)
        with clock.stage("torch import"):
            import torch
            import torch.distributed as dist

        if os.environ.get(STANDBY_ENV) == "1":
            self._stand_by()
        megatron_import = None
        if self.device_kind == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("--device cuda but torch sees no CUDA device on this host")
            # Megatron-Core's import is seconds of Python; CUDA's and NCCL's initialisation are
            # seconds in C: one overlaps the other.
            megatron_import = _InThread("Megatron-Core import", clock, _import_megatron)
            with clock.stage("CUDA init"):
                torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            backend = "nccl"
        else:
            from mnb.megatron import cpu

            with clock.stage("Megatron-Core import and CPU redirection"):
                cpu.install()
            route_warnings(self.rank, verbose)  # cpu.install() ignores the apex notices: log or show them
            from mnb.megatron import collectives

            collectives.install()  # gloo: mnb counts collectives (NCCL ranks have the Flight Recorder)
            self.device = torch.device("cpu")
            backend = "gloo"
        kwargs: dict[str, Any] = {"backend": backend}
        if backend == "nccl":
            kwargs["device_id"] = self.device
        with clock.stage(f"process group ({backend})"):
            dist.init_process_group(**kwargs)
        self.backend = backend
        if megatron_import is not None:
            megatron_import.result()

        with clock.stage("mnb: layout and recording"):
            from megatron.core import parallel_state

            from mnb.config import ParallelConfig
            from mnb.megatron import autorecord, events, layout

            layout.apply_layout(ParallelConfig())
            autorecord.install()  # a cell's or script's own get_forward_backward_func calls are measured
        self.layout = layout.current_layout().as_dict()
        events.set_sink(self._send_event)
        self.cell_id: str | None = None

        import mnb

        self.namespace.update(
            rank=self.rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            device=self.device,
            torch=torch,
            dist=dist,
            ps=parallel_state,
            mnb=mnb,
            display=self.display,
        )
        self.channel.send(
            Message(
                "hello",
                header={
                    "rank": self.rank,
                    "world_size": self.world_size,
                    "local_rank": self.local_rank,
                    "node_rank": self.node_rank,
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "device": str(self.device),
                    "device_name": self._device_name(),
                    "backend": backend,
                    "coords": layout.coordinates(),
                    "layout": self.layout,
                    "torch": torch.__version__,
                    "megatron": _megatron_version(),
                    "startup": clock.as_header(),
                },
            )
        )
        if self.device.type == "cuda":
            _warm_fused_kernels_in_background(self.device)

    def _stand_by(self) -> None:
        """A standby rank: Megatron-Core imported, then wait for ``go`` before CUDA or any process group.

        The controller launched this rank ahead of need (``mnb/controller/standby.py``); until
        ``go`` it holds host memory only.  The channel's I/O thread watches the controller
        as for any rank, so a standby whose kernel died exits on its own.
        """
        with self.clock.stage("standby: Megatron-Core import"):
            if self.device_kind == "cuda":
                _import_megatron()  # pure Python: no CUDA call
            else:
                from mnb.megatron import cpu

                cpu.install()
                _import_megatron()  # what the first model needs, ahead of the go
        self.channel.send(Message("standby", header={"rank": self.rank, "pid": os.getpid(),
                                                     "host": socket.gethostname()}))
        with self.clock.stage("standby: waiting for go"):
            while True:
                try:
                    message = self.channel.inbox.get()
                except KeyboardInterrupt:
                    continue
                if message.type == "go":
                    break
                if message.type == "shutdown":
                    self.channel.close()
                    os._exit(0)

    def _device_name(self) -> str:
        import torch

        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "cpu"

    # ------------------------------------------------------------- helpers
    def status(self) -> dict[str, Any]:
        """Answered from the I/O thread, also while a cell runs."""
        import psutil
        import torch

        info: dict[str, Any] = {"pid": os.getpid(), "device": str(getattr(self, "device", "?"))}
        info["rss_bytes"] = psutil.Process().memory_info().rss
        if getattr(self, "device", None) is not None and self.device.type == "cuda":
            info["memory_bytes"] = torch.cuda.memory_allocated(self.device)
            info["memory_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
        else:
            info["memory_bytes"] = info["rss_bytes"]
        info["layout"] = self.layout
        return info

    def display(self, *objs: Any, force: bool = False) -> None:
        """Show objects in the notebook (from the display rank, or any rank with force=True)."""
        if not (self.display_here or force):
            return
        for obj in objs:
            self.channel.send(
                Message("display", header={"rank": self.rank, "cell": self.cell_id}, payload=mime_bundle(obj))
            )

    def _send_event(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == "run_record":  # records travel with the cell's reply
            return
        self.channel.send(
            Message("event", header={"rank": self.rank, "kind": kind, "cell": self.cell_id}, payload=payload)
        )

    # ---------------------------------------------------------------- loop
    def serve(self) -> None:
        self.fd_capture.start()  # child processes' output reaches the cells (capture.FdCapture)
        sys.stdout, sys.stderr = self.stdout, self.stderr
        while True:
            try:
                message = self.channel.inbox.get()
            except KeyboardInterrupt:  # an interrupt that arrived between cells
                continue
            if message.type == "shutdown":
                self.channel.reply(message, ok=True)
                return
            try:
                handler = getattr(self, f"_on_{message.type}")
                handler(message)
            except BaseException as exc:  # one message's failure is its error reply, never the rank's end
                outcome = describe_exception(exc)
                if isinstance(exc, KeyboardInterrupt):
                    evalue, text = "", ""
                else:
                    log.warning("rank %d could not handle %s: %s", self.rank, message.type, outcome.evalue)
                    evalue = f"could not handle {message.type!r}: {outcome.evalue}"  # the label names the rank
                    text = outcome.traceback
                try:
                    self.channel.reply(message, ok=False, ename=outcome.ename, evalue=evalue, traceback=text)
                except Exception as reply_exc:  # plain strings: only a closing channel gets here
                    log.error("rank %d could not send the error reply: %s", self.rank, reply_exc)
            finally:
                self.channel.busy.clear()

    def _on_execute(self, message: Message) -> None:
        self.cell_id = message.id
        self.stdout.cell_id = self.stderr.cell_id = message.id
        self.display_here = self.rank in (message.get("display_ranks") or [])
        self.channel.busy.set()
        self.fd_capture.cell_id = message.id
        if message.get("post_mortem"):  # %mnb debug: the kept failure stays for another look
            self._post_mortem(message)
            return
        if self.last_failure is not None:  # the next cell: the failed one's frames (and tensors) go
            release_frames(self.last_failure)
            self.last_failure = None
        with stdin.forwarded(self.channel, self.rank, message.id, message.get("debug_ranks")):
            self._execute(message)

    def _post_mortem(self, message: Message) -> None:
        """pdb on the frame where this rank's last cell failed, through the notebook's stdin."""
        from mnb.megatron import layout

        failure, outcome = self.last_failure, None
        if failure is not None:
            print(f"post-mortem of {type(failure).__name__}: {failure}", flush=True)
            with stdin.forwarded(self.channel, self.rank, message.id, None):
                try:
                    stdin.post_mortem(failure, skip_file=sys.modules[run_cell.__module__].__file__)
                except BaseException as exc:  # no stdin, an interrupt: the request's error
                    outcome = describe_exception(exc)
        self.fd_capture.drain()
        self.fd_capture.cell_id = None
        self.channel.busy.clear()
        error = {"ename": outcome.ename, "evalue": outcome.evalue, "traceback": outcome.traceback} if outcome else {}
        self.channel.reply(message, payload={"value": None, "records": []}, ok=outcome is None,
                           kept=failure is not None, coords=layout.coordinates(), layout=self.layout, **error)

    def _execute(self, message: Message) -> None:
        from mnb.megatron import events, layout

        outcome = None
        kernel = message.get("kernel") or {}  # the notebook's cwd and environment changes
        sandbox.apply_environ(kernel.get("environ") if not message.get("script") else None)
        requested = message.get("layout")
        if requested:
            try:
                from mnb.config import ParallelConfig

                layout.apply_layout(ParallelConfig(**requested))
                self.layout = layout.current_layout().as_dict()
            except BaseException as exc:
                outcome = describe_exception(exc)
        if outcome is None and message.get("script"):  # %mnb run SCRIPT ARGS (mnb.worker.script)
            from mnb.worker.script import run_script

            outcome = run_script(message["script"], self.namespace, ranks=message.get("ranks") or [self.rank],
                                 cpu_ranks=self.device.type == "cpu", kernel=kernel)
        elif outcome is None and message.get("after_script"):
            from mnb.worker.script import restore_pool_state

            outcome = restore_pool_state()
        if outcome is None:
            from mnb.megatron import profile

            # %%megatron --profile (message["profile"]); mnb.train(profile=...) writes into the cell's folder
            default_dir = self.profiles_root / f"cell-{message.id}" if self.profiles_root else None
            with profile.cell(message.get("profile"), self.rank, default_dir) as report:
                outcome = run_cell(message["code"], self.namespace, keep_failure=True)
                self.last_failure = outcome.exception
                if not outcome.ok:
                    report["error"] = f"{outcome.ename}: {outcome.evalue}"
        self.fd_capture.drain()
        self.fd_capture.cell_id = None
        self.channel.busy.clear()
        if self.display_here:
            for figure in open_figures():
                self.display(figure)
            if outcome.ok and outcome.value is not None and message.get("show_result"):
                self.channel.send(
                    Message(
                        "display",
                        header={"rank": self.rank, "cell": message.id, "result": True},
                        payload=mime_bundle(outcome.value),
                    )
                )
        close_figures()
        records = events.take_records()
        value = portable(outcome.value) if message.get("want_value") and outcome.ok else None
        self.channel.reply(
            message,
            payload={"value": value, "records": records},
            ok=outcome.ok,
            ename=outcome.ename,
            evalue=outcome.evalue,
            traceback=outcome.traceback,
            coords=layout.coordinates(),
            layout=self.layout,
        )

    def _on_push(self, message: Message) -> None:
        """Bind the pushed names: each arrives pickled on its own (``values.encode_push``); all or none."""
        import pickle

        payload = message.payload or {}
        if not message.get("encoded"):
            self.namespace.update(payload)
            self.channel.reply(message, ok=True)
            return
        bound: dict[str, Any] = {}
        failed: dict[str, str] = {}
        for name, data in payload.items():
            try:
                bound[name] = pickle.loads(data)
            except Exception as exc:  # e.g. a module the kernel has and this host lacks
                failed[name] = f"{type(exc).__name__}: {exc}"
        if failed:
            self.channel.reply(
                message, ok=False, ename="UnpicklingError",
                evalue=f"cannot rebuild {', '.join(map(repr, failed))} (nothing was bound): "
                + "; ".join(f"{name}: {why}" for name, why in failed.items()),
            )
            return
        self.namespace.update(bound)
        self.channel.reply(message, ok=True)

    def _on_pull(self, message: Message) -> None:
        missing = [name for name in message["names"] if name not in self.namespace]
        if missing:
            self.channel.reply(
                message, ok=False, ename="NameError", evalue=f"name(s) not defined on rank {self.rank}: {', '.join(missing)}"
            )
            return
        from mnb import values

        # One kernel-safe pickle per name (decoded by values.decode_values in the kernel),
        # so the message itself always unpickles there whatever the values hold.
        encoded = values.encode_values({name: self.namespace[name] for name in message["names"]})
        self.channel.reply(message, payload=encoded, ok=True, encoded=True)


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


def _collectives_snapshot() -> Any:
    """The ``stacks`` answer's collective part: nothing before torch.distributed is imported."""
    if "torch.distributed" not in sys.modules:
        return None
    from mnb.megatron import collectives

    return collectives.snapshot()


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


def _interrupts_deferred() -> bool:
    """Whether the main thread is in mnb.train, which stops at a step boundary (never imports Megatron)."""
    interrupts = sys.modules.get("mnb.megatron.interrupts")
    return bool(interrupts and interrupts.is_deferring())


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:  # e.g. Megatron-LM on PYTHONPATH instead of the wheel
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mnb.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True, help="connection file written by the controller")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=os.environ.get("MNB_DEVICE", "cpu"))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("MNB_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s mnb rank {os.environ.get('RANK', '?')} %(levelname)s %(name)s: %(message)s",
    )
    _die_with_parent()
    record_fatal_stacks(int(os.environ.get("RANK", "0")))
    rank = Rank(ConnectionInfo.read(args.connect), args.device)
    try:
        rank.start()
    except BaseException as exc:
        outcome = describe_exception(exc)
        rank.channel.send(
            Message("hello", header={"rank": rank.rank, "pid": os.getpid(), "failed": True,
                                     "ename": outcome.ename, "evalue": outcome.evalue,
                                     "traceback": outcome.traceback, "host": socket.gethostname()})
        )
        time.sleep(0.5)
        raise
    rank.serve()
    _shutdown(rank)


def _shutdown(rank: Rank) -> None:
    import torch.distributed as dist

    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    rank.channel.close()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # exiting anyway; say why teardown was incomplete
        log.warning("destroy_process_group failed: %s", exc)
    os._exit(0)
