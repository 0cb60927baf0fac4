"""The rank's connection to the controller, owned by one I/O thread.

ZeroMQ sockets are not thread-safe, and the main thread may be stuck inside
user code or a collective for minutes.  So one daemon thread owns the DEALER
socket and answers what must be answered even while a cell runs: heartbeats,
``status``, ``stacks`` and ``interrupt``.  Cells (``execute``/``push``/
``pull``/``shutdown``) are handed to the main thread through a queue.

Other threads send through :meth:`Channel.send`, which goes over an inproc
PUSH/PULL pair so the I/O thread wakes at once (no polling delay on the hot
path of a cell's reply).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import zmq

from mnb.protocol import ConnectionInfo, Message, ProtocolError, Signer, drain

log = logging.getLogger(__name__)

MAIN_THREAD_TYPES = frozenset({"execute", "push", "pull", "shutdown"})
HEARTBEAT_INTERVAL_S = 1.0
FIRST_CONTACT_TIMEOUT_S = 600.0


class Channel:
    """Signed messaging with the controller plus the rank's control plane."""

    def __init__(
        self,
        info: ConnectionInfo,
        rank: int,
        status_fn: Callable[[], dict[str, Any]],
        controller_timeout_s: float = 15.0,
    ):
        self.rank = rank
        self._signer = Signer(info.key)
        self._status_fn = status_fn
        self._controller_timeout_s = controller_timeout_s
        self._controller_pid = info.controller_pid if _same_host(info) else None
        self.inbox: "queue.Queue[Message]" = queue.Queue()
        self.busy = threading.Event()
        self.closing = threading.Event()
        self._main_ident = threading.main_thread().ident
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, f"rank-{rank}".encode())
        self._socket.setsockopt(zmq.LINGER, 2000)
        self._socket.connect(info.address)
        self._outbox_addr = f"inproc://mnb-outbox-{id(self)}"
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(self._outbox_addr)
        self._local = threading.local()
        self._last_heard = time.monotonic()
        self._heard_once = False
        self._thread = threading.Thread(target=self._loop, name="mnb-io", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- sending
    def send(self, message: Message) -> None:
        """Queue a message for the controller; safe from any thread."""
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 2000)
            push.connect(self._outbox_addr)
            self._local.push = push
        push.send_multipart(self._signer.encode(message))

    def reply(self, request: Message, payload: Any = None, **header: Any) -> None:
        self.send(Message("reply", id=request.id, header={"rank": self.rank, **header}, payload=payload))

    # --------------------------------------------------------- I/O thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        next_beat = 0.0
        while not self.closing.is_set():
            events = dict(poller.poll(200))
            if self._pull in events:
                drain(self._pull, self._socket.send_multipart)
            if self._socket in events:
                drain(self._socket, self._handle)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_INTERVAL_S
                self._socket.send_multipart(
                    self._signer.encode(
                        Message("heartbeat", header={"rank": self.rank, "busy": self.busy.is_set()})
                    )
                )
                if self._controller_gone(now):
                    self._exit_orphaned()

    def _handle(self, frames: list[bytes]) -> None:
        try:
            message = self._signer.decode(frames)
        except ProtocolError as exc:
            log.warning("rank %d dropped a message: %s", self.rank, exc)
            return
        self._last_heard = time.monotonic()
        self._heard_once = True
        kind = message.type
        if kind == "heartbeat":
            return
        if kind in MAIN_THREAD_TYPES:
            self.inbox.put(message)
        elif kind == "interrupt":
            self.interrupt_main()
            self.reply(message, interrupted=self.busy.is_set())
        elif kind == "stacks":
            self.reply(message, stacks=main_thread_stack(self._main_ident), busy=self.busy.is_set())
        elif kind == "status":
            try:
                status = self._status_fn()
            except Exception as exc:  # status must never kill the I/O thread
                status = {"error": f"{type(exc).__name__}: {exc}"}
            self.reply(message, **status, busy=self.busy.is_set())

    def interrupt_main(self) -> None:
        """Raise KeyboardInterrupt in the main thread, only while a cell runs.

        A real SIGINT (not ``_thread.interrupt_main``) so that blocking system
        calls such as ``time.sleep`` return at once with EINTR.
        """
        if self.busy.is_set() and self._main_ident is not None:
            signal.pthread_kill(self._main_ident, signal.SIGINT)

    def _controller_gone(self, now: float) -> bool:
        if self._controller_pid is not None and not _pid_alive(self._controller_pid):
            return True
        # Until the first message arrives (imports and NCCL set-up can take a while
        # and hold the GIL) allow the controller's whole start-up timeout.
        limit = self._controller_timeout_s if self._heard_once else FIRST_CONTACT_TIMEOUT_S
        return now - self._last_heard > limit

    def _exit_orphaned(self) -> None:
        print(f"mnb rank {self.rank}: controller is gone, exiting", file=sys.__stderr__, flush=True)
        os._exit(0)

    def close(self) -> None:
        self.closing.set()
        self._thread.join(timeout=3)
        self._socket.close(linger=1000)
        self._pull.close(linger=0)


def main_thread_stack(main_ident: int | None) -> str:
    """The main thread's current Python stack, innermost call last.

    Starts at the cell's outermost frame when a cell is running, so the
    user sees their own code, not mnb's exec loop.
    """
    frame = sys._current_frames().get(main_ident) if main_ident is not None else None
    if frame is None:
        return "(main thread not found)"
    frames = traceback.extract_stack(frame)
    for index, summary in enumerate(frames):
        if summary.filename.startswith("<cell-"):
            frames = frames[index:]
            break
    return "".join(traceback.format_list(frames))


def _same_host(info: ConnectionInfo) -> bool:
    import socket

    return info.controller_host in (None, socket.gethostname())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
