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
default layout, says hello (``mnb/worker/boot.py``), and then runs cells until told to
shut down.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from mnb.worker.startup import StartClock  # first: its import time is when the rank's own code began
from mnb.worker import sandbox  # noqa: F401  (second: it records the rank's original sys.path)
from mnb.errors import MessageTooLarge
from mnb.paths import in_mnb
from mnb.protocol import ConnectionInfo, Message, ProtocolError, version_mismatch
from mnb.worker import boot, debugging, stdin
from mnb.worker.capture import FdCapture, RankStream, close_figures, mime_bundle, open_figures, plain_streams_after_fork
from mnb.worker.channel import Channel
from mnb.worker.executor import Outcome, describe_exception, portable, run_cell
from mnb.worker.faults import record_fatal_stacks
from mnb.worker.late_start import LateStart

log = logging.getLogger("mnb.worker")


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
        self.device: Any = None
        """``torch.device`` of this rank, set by :func:`boot.start` (torch is not imported before then)."""
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
        self.cwd_missing: str | None = None
        """The notebook's directory this host lacks, once said (``follow_kernel``); None while cells follow it."""
        self.late: LateStart | None = None
        """The start's part after the hello (Megatron-Core, the default layout): the one owner of whether
        this rank is ready for cells; set by :func:`boot.start`."""
        self.cell_id: str | None = None
        """The ``execute`` this rank runs or ran last (its output and events are labelled with it)."""

    @property
    def layout(self) -> dict[str, Any] | None:
        """The layout this rank's process groups have now; None before boot or while a change is half done.

        Read from ``mnb.megatron.layout`` at each ask, never stored here: an interrupt that lands
        inside a layout change (after Megatron's groups went, before the new ones came) must be
        answered with "no layout", not with the layout the rank had before (a CI run found a
        rank reporting its old layout with no groups at all, which the controller then trusted).
        """
        if self.late is not None and not self.late.ready:  # the default layout, built before any cell runs
            from mnb.config import ParallelConfig

            return ParallelConfig().resolve(self.world_size).as_dict()
        module = sys.modules.get("mnb.megatron.layout")
        current = module.current_layout() if module is not None else None
        return current.as_dict() if current is not None else None

    # -------------------------------------------------------------- start
    def start(self) -> None:
        """Get the rank ready and say hello (``mnb/worker/boot.py``)."""
        boot.start(self)

    # ------------------------------------------------------------- helpers
    def status(self) -> dict[str, Any]:
        """Answered from the I/O thread, also while a cell runs."""
        import psutil
        import torch

        info: dict[str, Any] = {"pid": os.getpid(), "device": str(self.device or "?")}
        info["rss_bytes"] = psutil.Process().memory_info().rss
        if self.device is not None and self.device.type == "cuda":
            info["memory_bytes"] = torch.cuda.memory_allocated(self.device)
            info["memory_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
        else:
            info["memory_bytes"] = info["rss_bytes"]
        info["layout"] = self.layout
        if self.late is not None and not self.late.ready:
            info["starting"] = self.late.doing()  # e.g. "importing Megatron-Core, 3.1 s so far"
        return info

    def display(self, *objs: Any, force: bool = False) -> None:
        """Show objects in the notebook (from the display rank, or any rank with force=True)."""
        if not (self.display_here or force):
            return
        for obj in objs:
            self.channel.send(
                Message("display", header={"rank": self.rank, "cell": self.cell_id}, payload=mime_bundle(obj))
            )

    def send_event(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == "run_record":  # records travel with the cell's reply
            return
        self.channel.send(
            Message("event", header={"rank": self.rank, "kind": kind, "cell": self.cell_id}, payload=payload)
        )

    # ---------------------------------------------------------------- loop
    def serve(self) -> None:
        self.fd_capture.start()  # child processes' output reaches the cells (capture.FdCapture)
        sys.stdout, sys.stderr = self.stdout, self.stderr
        plain_streams_after_fork()
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
                # a cell's reply names the layout the rank has, also when the interrupt landed in mnb's own code
                where = {"layout": self.layout} if message.type == "execute" else {}
                try:
                    self.channel.reply(message, ok=False, ename=outcome.ename, evalue=evalue, traceback=text,
                                       **where)
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
            debugging.post_mortem(self, message)
            return
        if not message.get("after_script"):  # the pool's layout after a script: its failure stays for %mnb debug
            debugging.forget_failure(self)  # the next cell: the failed one's frames (and tensors) go
        self.late.finish()  # the first cell waits for Megatron-Core and the default layout, and says so
        with stdin.forwarded(self.channel, self.rank, message.id, message.get("debug_ranks")):
            self._execute(message)

    def follow_kernel(self, kernel: dict[str, Any], *, script: bool) -> None:
        """Run where the notebook is: its directory, where this host has it (else one line, once per
        directory, says where the rank stays); a cell's environment changes (a script's: its sandbox)."""
        if not script:
            sandbox.apply_environ(kernel.get("environ"))
        cwd = kernel.get("cwd")
        if not cwd:  # a request from Python without the kernel's context: the rank stays where it is
            return
        if sandbox.follow_cwd(cwd):
            self.cwd_missing = None
        elif cwd != self.cwd_missing:
            self.cwd_missing = cwd
            print(f"mnb: the notebook's directory {cwd} does not exist on {socket.gethostname()}: this host's "
                  f"ranks stay in {os.getcwd()}, where their relative paths start (said once)", flush=True)

    def _execute(self, message: Message) -> None:
        from mnb.megatron import events, layout

        outcome = None
        counting = sys.modules.get("mnb.megatron.collectives")
        if counting is not None:  # collective numbers in hang reports count from the start of this cell
            counting.begin_cell()
        profile_dir = None  # the folder this rank wrote the cell's profile to (mnb.megatron.profile)
        kernel = message.get("kernel") or {}  # the notebook's cwd and environment changes
        self.follow_kernel(kernel, script=bool(message.get("script")))
        requested = message.get("layout")
        if requested:
            try:
                from mnb.config import ParallelConfig

                layout.apply_layout(ParallelConfig(**requested))
            except BaseException as exc:
                outcome = describe_exception(exc)
        if outcome is None and message.get("script"):  # %mnb run SCRIPT ARGS (mnb.worker.script)
            from mnb.worker.script import run_script

            outcome = run_script(message["script"], self.namespace, ranks=message.get("ranks") or [self.rank],
                                 cpu_ranks=self.device.type == "cpu", kernel=kernel)
            self.last_failure = outcome.exception  # %mnb debug looks at a failed script as at a failed cell
        elif outcome is None and message.get("after_script"):
            from mnb.worker.script import restore_pool_state

            outcome = restore_pool_state()
        if outcome is None and message.get("code") is None:  # a layout alone (a restart's restore_layout)
            outcome = Outcome(ok=True)
        if outcome is None:
            from mnb.megatron import profile

            # %%megatron --profile (message["profile"]); mnb.train(profile=...) writes into the cell's folder
            default_dir = self.profiles_root / f"cell-{message.id}" if self.profiles_root else None
            with profile.cell(message.get("profile"), self.rank, default_dir) as report:
                outcome = run_cell(message["code"], self.namespace, keep_failure=True, number=message["number"])
                self.last_failure = outcome.exception
                if not outcome.ok:
                    report["error"] = f"{outcome.ename}: {outcome.evalue}"
            profile_dir = report.get("dir")
        self.end_cell()
        if self.display_here:
            for figure in open_figures():
                self.display(figure)
            if outcome.ok and outcome.value is not None and message.get("show_result"):
                self.show_result(message, outcome.value)
        close_figures()
        value = portable(outcome.value) if message.get("want_value") and outcome.ok else None
        self.reply_cell(message, outcome, value=value, records=events.take_records(), profile_dir=profile_dir)

    def show_result(self, message: Message, value: Any) -> None:
        """The cell's last expression, displayed.  A ``__repr__`` that raises is shown as IPython shows it (its
        traceback, the cell's own frames, on stderr) and the cell still succeeds; it failed on the display rank
        alone, with mnb's frames (a user trial)."""
        try:
            bundle = mime_bundle(value)
        except Exception as exc:  # noqa: BLE001 - the user's repr
            tb = exc.__traceback__
            while tb is not None and in_mnb(tb.tb_frame.f_code.co_filename):  # from the user's first frame on
                tb = tb.tb_next
            print("".join(traceback.format_exception(type(exc), exc, tb)).rstrip(), file=sys.stderr, flush=True)
            return
        self.channel.send(Message("display", header={"rank": self.rank, "cell": message.id, "result": True},
                                  payload=bundle))

    def end_cell(self) -> None:
        """Every execute's end, its reply aside: the cell's file-descriptor output is sent and the rank is idle."""
        self.fd_capture.drain()
        self.fd_capture.cell_id = None
        self.channel.busy.clear()

    def reply_cell(self, message: Message, outcome: Outcome, *, value: Any = None,
                   records: list[dict[str, Any]] | None = None, **extra: Any) -> None:
        """Every execute's reply: how it ended, the value and run records, and the coordinates and layout
        this rank has now (what the controller confirms the cell's layout against).  A value whose reply
        would pass the protocol's limit stays here: a note saying so travels instead (``values.too_large``)."""
        from mnb.megatron import layout
        from mnb.values import too_large

        def reply(value: Any) -> None:
            self.channel.reply(message, payload={"value": value, "records": records or []}, ok=outcome.ok,
                               ename=outcome.ename, evalue=outcome.evalue, traceback=outcome.traceback,
                               coords=layout.coordinates(), layout=self.layout, **extra)

        try:
            reply(value)
        except MessageTooLarge as exc:  # the cell succeeded: only its value cannot travel, so a note goes instead
            if value is None:
                raise
            reply(too_large(outcome.value, exc.size_bytes, exc.limit_bytes, self.rank))

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


def _collectives_snapshot() -> Any:
    """The ``stacks`` answer's collective part: nothing before torch.distributed is imported."""
    if "torch.distributed" not in sys.modules:
        return None
    from mnb.megatron import collectives

    return collectives.snapshot()


def _interrupts_deferred() -> bool:
    """Whether the main thread is in mnb.train, which stops at a step boundary (never imports Megatron)."""
    interrupts = sys.modules.get("mnb.megatron.interrupts")
    return bool(interrupts and interrupts.is_deferring())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mnb.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True, help="connection file written by the controller")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=os.environ.get("MNB_DEVICE", "cpu"))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("MNB_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s mnb rank {os.environ.get('RANK', '?')} %(levelname)s %(name)s: %(message)s",
    )
    boot.die_with_parent()
    record_fatal_stacks(int(os.environ.get("RANK", "0")))
    info = ConnectionInfo.read(args.connect)
    rank = Rank(info, args.device)
    try:
        mismatch = version_mismatch(info.protocol_version, f"the controller that wrote {args.connect}")
        if mismatch:
            raise ProtocolError(mismatch)
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
