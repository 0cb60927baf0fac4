"""The rank's connection to the controller, owned by one I/O thread.

ZeroMQ sockets are not thread-safe, and the main thread may be stuck inside
user code or a collective for minutes.  So one daemon thread owns the DEALER
socket and answers what must be answered even while a cell runs: heartbeats,
``status``, ``stacks`` and ``interrupt``.  Cells (``execute``/``push``/
``pull``/``shutdown``) are handed to the main thread through a queue; answers to a
cell's ``input()`` (``input_reply``) through another, which the waiting cell reads.

Sending.  Every thread appends to one ordered outbox (a deque under a lock)
and, when the I/O thread must act, writes a byte to a pipe the thread polls.
Messages are encoded (pickled and signed) in the calling thread, so pickling
errors reach the caller; stream text is coalesced per (stream, cell) into
chunks of at most :data:`STREAM_CHUNK_CHARS` and sent at most every
:data:`STREAM_INTERVAL_S` (a first chunk after a quiet spell goes at once).
Any other message is sent at once, after every chunk queued before it, so a
cell's text always arrives before its reply.  Sends never block: what ZeroMQ
will not take now waits in a bounded backlog, retried on the next turn; past
:data:`BACKLOG_MAX_BYTES` the oldest stream text is dropped first (counted).

The controller's death.  Every :data:`LIVENESS_INTERVAL_S` the I/O thread
checks the controller process (same host: gone, a zombie, or a different
process under its PID by start time) and its heartbeat (any host: silent
for ``controller_timeout_s``).  An orphaned rank kills the processes it
started, removes the pool's connection file (and its ``mnb-pool-*`` folder)
when the controller process is gone, and exits.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import queue
import secrets
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import psutil
import zmq

from mnb.protocol import MAX_MESSAGE_BYTES, ConnectionInfo, Message, ProtocolError, Signer, drain
from mnb.timeouts import CONTROLLER_SILENCE_S, FIRST_CONTACT_TIMEOUT_S, HEARTBEAT_INTERVAL_S, INTERRUPT_NUDGE_S
from mnb.units import MIB

log = logging.getLogger(__name__)

MAIN_THREAD_TYPES = frozenset({"execute", "push", "pull", "shutdown", "go"})
LIVENESS_INTERVAL_S = 0.5
STREAM_INTERVAL_S = 0.02
"""Stream text is sent at most this often (a first chunk after a quiet spell goes at once)."""
STREAM_CHUNK_CHARS = 2**20
"""Characters of text in one ``stream`` message, at most."""
BACKLOG_MAX_BYTES = 64 * MIB
"""Encoded messages ZeroMQ would not take yet; past this the oldest stream text is dropped."""
SEND_HWM = 64
"""Messages ZeroMQ itself queues for the controller before sends wait in the backlog."""
RETRY_INTERVAL_S = 0.02
CREATE_TIME_TOLERANCE_S = 1.0
KILL_GRACE_S = 1.0
NUDGE_SIGNAL = signal.SIGURG
"""Sent after an interrupt to wake a wait that missed its SIGINT (``INTERRUPT_NUDGE_S``).  Its handler does
nothing, so a nudge after the interrupt was raised changes nothing (a second SIGINT could land in the
first one's ``except`` blocks); SIGURG, because nothing a rank runs uses it (sockets' out-of-band data)."""


def _nudged(signum: int, frame: object) -> None:
    """NUDGE_SIGNAL's handler: none needed; being a Python handler is what makes the signal interrupt a wait."""


class _Chunk:
    """Stream text of one (stream name, cell) waiting in the outbox."""

    __slots__ = ("name", "cell", "parts", "chars")

    def __init__(self, name: str, cell: str | None):
        self.name, self.cell = name, cell
        self.parts: list[str] = []
        self.chars = 0


class Channel:
    """Signed messaging with the controller plus the rank's control plane."""

    def __init__(
        self,
        info: ConnectionInfo,
        rank: int,
        status_fn: Callable[[], dict[str, Any]],
        controller_timeout_s: float = CONTROLLER_SILENCE_S,
        deferring_fn: Callable[[], bool] = lambda: False,
        collectives_fn: Callable[[], Any] = lambda: None,
    ):
        self.rank = rank
        self._deferring_fn = deferring_fn
        self._collectives_fn = collectives_fn
        self.identity = b"r%d-" % rank + secrets.token_hex(8).encode()
        self._identity_text = self.identity.decode()
        self._signer = Signer(info.key)
        self._status_fn = status_fn
        self._controller_timeout_s = controller_timeout_s
        same_host = _same_host(info)
        self._controller_pid = info.controller_pid if same_host else None
        self._controller_started = info.controller_started if same_host else None
        self._connection_file = info.path if same_host else None
        self.inbox: "queue.Queue[Message]" = queue.Queue()
        self.answers: "queue.Queue[Message]" = queue.Queue()
        """``input_reply`` messages, for the thread that waits in ``input()`` (``mnb.worker.stdin``)."""
        self.busy = threading.Event()
        self.closing = threading.Event()
        self.received: collections.Counter[str] = collections.Counter()
        self.dropped_stream_chars = 0  # stream text dropped because the controller did not take it
        self.dropped_messages = 0  # other messages dropped for the same reason
        self._main_ident = threading.main_thread().ident
        self._outbox: collections.deque[_Chunk | list[bytes]] = collections.deque()
        self._outbox_lock = threading.Lock()
        self._urgent = 0  # non-stream messages in the outbox
        self._stream_waiting = False  # stream text in the outbox
        self._next_stream_s = 0.0
        self._backlog: collections.deque[tuple[list[bytes], int, int]] = collections.deque()
        self._backlog_bytes = 0
        self._dropping = False
        self._bell_read, self._bell_write = os.pipe()
        os.set_blocking(self._bell_read, False)
        os.set_blocking(self._bell_write, False)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.identity)
        self._socket.setsockopt(zmq.LINGER, 2000)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.connect(info.address)
        self._last_heard = time.monotonic()
        self._heard_once = False
        self._nudges: collections.deque[float] = collections.deque()  # when the main thread is nudged next
        self._nudge_at: tuple[int, int] | None = None  # where the main thread stood when it was interrupted
        if threading.current_thread() is threading.main_thread():
            signal.signal(NUDGE_SIGNAL, _nudged)
        self._thread = threading.Thread(target=self._loop, name="mnb-io", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- sending
    def send(self, message: Message) -> None:
        """Queue a message for the controller; safe from any thread, never blocks.

        Encoded here, so an unpicklable or too large payload raises in the caller
        (:class:`~mnb.protocol.MessageTooLarge` past the protocol's limit).
        """
        if message.type == "stream":
            self.write_stream(message.get("name", "stdout"), message.get("text") or "", message.get("cell"))
            return
        frames = self._signer.encode(self._stamped(message))
        with self._outbox_lock:
            self._outbox.append(frames)
            self._urgent += 1
            self._ring()

    def reply(self, request: Message, payload: Any = None, **header: Any) -> None:
        self.send(Message("reply", id=request.id, header={"rank": self.rank, **header}, payload=payload))

    def write_stream(self, name: str, text: str, cell_id: str | None) -> None:
        """Queue ``text`` of stream ``name`` (stdout/stderr) printed by cell ``cell_id``."""
        if not text:
            return
        with self._outbox_lock:
            while text:
                last = self._outbox[-1] if self._outbox else None
                if not (
                    type(last) is _Chunk
                    and last.name == name
                    and last.cell == cell_id
                    and last.chars < STREAM_CHUNK_CHARS
                ):
                    last = _Chunk(name, cell_id)
                    self._outbox.append(last)
                piece = text[: STREAM_CHUNK_CHARS - last.chars]
                text = text[len(piece):]
                last.parts.append(piece)
                last.chars += len(piece)
            if not self._stream_waiting:
                self._stream_waiting = True
                self._ring()

    def _stamped(self, message: Message) -> Message:
        header = {"rank": self.rank, **message.header, "identity": self._identity_text}
        return Message(message.type, id=message.id, header=header, payload=message.payload)

    def _ring(self) -> None:
        """Wake the I/O thread (called with the outbox lock held)."""
        if self._bell_write < 0:
            return
        try:
            os.write(self._bell_write, b"\0")
        except BlockingIOError:  # the pipe is full of rings: the thread is waking anyway
            pass

    # --------------------------------------------------------- I/O thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._bell_read, zmq.POLLIN)
        next_beat = next_check = 0.0
        while not self.closing.is_set():
            try:
                now = time.monotonic()
                wake = min(next_beat, next_check)
                if self._backlog:
                    wake = min(wake, now + RETRY_INTERVAL_S)
                if self._nudges:
                    wake = min(wake, self._nudges[0])
                with self._outbox_lock:
                    if self._urgent:
                        wake = now
                    elif self._stream_waiting:
                        wake = min(wake, self._next_stream_s)
                events = dict(poller.poll(math.ceil(max(0.0, wake - now) * 1000)))
                if self._bell_read in events:
                    _empty_pipe(self._bell_read)
                if self._socket in events:
                    drain(self._socket, self._handle)
                now = time.monotonic()
                self._pump(now)
                self._nudge(now)
                if now >= next_beat:
                    next_beat = now + HEARTBEAT_INTERVAL_S
                    self._send_heartbeat()
                if now >= next_check:
                    next_check = now + LIVENESS_INTERVAL_S
                    reason = self._controller_gone(now)
                    if reason:
                        self._exit_orphaned(reason)
            except Exception:  # the I/O thread must outlive any one bad turn, or the rank goes deaf
                log.exception("rank %d: error in the I/O thread", self.rank)
        self._flush_before_close(deadline=time.monotonic() + 1.0)

    def _pump(self, now: float, force: bool = False) -> None:
        """Move what is due from the outbox to the backlog, then send what ZeroMQ takes."""
        with self._outbox_lock:
            due = force or self._urgent or (self._stream_waiting and now >= self._next_stream_s)
            if due and self._outbox:
                taken, self._outbox = self._outbox, collections.deque()
                had_stream, self._urgent, self._stream_waiting = self._stream_waiting, 0, False
            else:
                taken, had_stream = None, False
        if had_stream:
            self._next_stream_s = now + STREAM_INTERVAL_S
        for entry in taken or ():
            if type(entry) is _Chunk:
                text = "".join(entry.parts)
                message = Message("stream", header={"rank": self.rank, "name": entry.name, "text": text,
                                                    "cell": entry.cell})
                frames, chars = self._signer.encode(self._stamped(message)), entry.chars
            else:
                frames, chars = entry, 0
            size = sum(len(frame) for frame in frames)
            self._backlog.append((frames, size, chars))
            self._backlog_bytes += size
        if taken:
            self._trim_backlog()
        self._send_backlog()

    def _trim_backlog(self) -> None:
        while self._backlog_bytes > BACKLOG_MAX_BYTES and len(self._backlog) > 1:
            index = next((i for i, entry in enumerate(self._backlog) if entry[2]), 0)
            frames, size, chars = self._backlog[index]
            del self._backlog[index]
            self._backlog_bytes -= size
            if chars:
                self.dropped_stream_chars += chars
            else:
                self.dropped_messages += 1
            if not self._dropping:  # once per spell, not per chunk: stderr may be a pipe too
                self._dropping = True
                log.warning("rank %d: the controller is not reading; dropping the oldest output", self.rank)

    def _send_backlog(self) -> None:
        while self._backlog:
            frames, size, _ = self._backlog[0]
            try:
                self._socket.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:  # the controller is not reading now: retry on the next turn
                return
            self._backlog.popleft()
            self._backlog_bytes -= size
        self._dropping = False

    def _send_heartbeat(self) -> None:
        beat = Message("heartbeat", header={"rank": self.rank})  # busy: in status and stacks answers
        try:
            self._socket.send_multipart(self._signer.encode(self._stamped(beat)), zmq.NOBLOCK)
        except zmq.Again:  # a heartbeat that cannot go now is worth nothing later
            pass

    def _flush_before_close(self, deadline: float) -> None:
        while True:
            self._pump(time.monotonic(), force=True)
            if not self._backlog or time.monotonic() >= deadline:
                return
            self._socket.poll(10, zmq.POLLOUT)

    def _handle(self, frames: list[bytes]) -> None:
        try:
            message = self._signer.decode(frames)
        except ProtocolError as exc:
            log.warning("rank %d dropped a message: %s", self.rank, exc)
            return
        self.received[message.type] += 1
        self._last_heard = time.monotonic()
        self._heard_once = True
        kind = message.type
        if kind == "heartbeat":
            return
        if kind in MAIN_THREAD_TYPES:
            self.inbox.put(message)
        elif kind == "input_reply":  # the main thread waits for it inside a cell, not in the exec loop
            self.answers.put(message)
        elif kind == "interrupt":
            self.interrupt_main()
            # deferred: the main thread holds interrupts until a step boundary (mnb.train)
            self.reply(message, interrupted=self.busy.is_set(), deferred=self._deferring_fn())
        elif kind == "stacks":
            self.reply(message, stacks=main_thread_stack(self._main_ident), busy=self.busy.is_set(),
                       collectives=self._collectives())
        elif kind == "status":
            try:
                status = self._status_fn()
            except Exception as exc:  # status must never kill the I/O thread
                status = {"error": f"{type(exc).__name__}: {exc}"}
            self.reply(message, **status, busy=self.busy.is_set())

    def _collectives(self) -> Any:
        """Which collective the rank is in (``mnb.megatron.collectives.snapshot``), or None."""
        try:
            return self._collectives_fn()
        except Exception:  # noqa: BLE001 - the stack is worth sending without it
            log.debug("rank %d: no collective snapshot", self.rank, exc_info=True)
            return None

    def interrupt_main(self) -> None:
        """Raise KeyboardInterrupt in the main thread, only while a cell runs.

        A real SIGINT (not ``_thread.interrupt_main``) so that blocking system
        calls such as ``time.sleep`` return at once with EINTR.
        """
        if self.busy.is_set() and self._main_ident is not None:
            self._nudge_at = self._main_position()
            signal.pthread_kill(self._main_ident, signal.SIGINT)
            now = time.monotonic()
            self._nudges = collections.deque(now + after for after in INTERRUPT_NUDGE_S)

    def _main_position(self) -> tuple[int, int] | None:
        """Where the main thread's Python code stands (its innermost frame and instruction): unchanged while
        it sits in one call, as a wait that missed its SIGINT does."""
        frame = sys._current_frames().get(self._main_ident)
        return None if frame is None else (id(frame), frame.f_lasti)

    def _nudge(self, now: float) -> None:
        """The nudges due after an interrupt (``INTERRUPT_NUDGE_S``, I/O thread): only while the cell runs and
        the main thread has not moved since the interrupt (once it moved, the interrupt was taken or the code
        goes on, and a signal there would only make a call return early)."""
        if not self._nudges or now < self._nudges[0]:
            return
        while self._nudges and now >= self._nudges[0]:
            self._nudges.popleft()
        if not self.busy.is_set() or self._main_position() != self._nudge_at:
            self._nudges.clear()
            return
        signal.pthread_kill(self._main_ident, NUDGE_SIGNAL)

    def _controller_gone(self, now: float) -> str:
        """Why the controller counts as gone ('' while it lives)."""
        if self._controller_pid is not None and not controller_alive(self._controller_pid, self._controller_started):
            return "exited"
        # Until the first message arrives (imports and NCCL set-up can take a while
        # and hold the GIL) allow the controller's whole start-up timeout.
        limit = self._controller_timeout_s if self._heard_once else FIRST_CONTACT_TIMEOUT_S
        if now - self._last_heard > limit:
            return f"silent for {limit:.0f} s"
        return ""

    def _exit_orphaned(self, reason: str) -> None:
        print(f"mnb rank {self.rank}: controller is gone ({reason}), exiting", file=sys.__stderr__, flush=True)
        try:
            kill_descendants(KILL_GRACE_S)
            # Only a controller known dead leaves its files to us: a silent one may be alive.
            if reason == "exited" and self._connection_file:
                remove_pool_files(self._connection_file)
        finally:
            os._exit(0)

    def close(self) -> None:
        self.closing.set()
        with self._outbox_lock:
            self._ring()
        self._thread.join(timeout=3)
        with self._outbox_lock:
            os.close(self._bell_write)
            self._bell_write = -1
        if self._thread.is_alive():  # the thread still owns the socket: leave it to process exit
            return
        os.close(self._bell_read)
        self._socket.close(linger=1000)
        self._context.term()


def controller_alive(pid: int, started: float | None) -> bool:
    """Whether process ``pid`` runs (not a zombie) and, if ``started`` is known, began then."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        if started is not None and abs(process.create_time() - started) > CREATE_TIME_TOLERANCE_S:
            return False  # the PID now names another process
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
    return True


def kill_descendants(grace_s: float) -> None:
    """SIGTERM every process this one started (recursively), SIGKILL what is left after ``grace_s``."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def remove_pool_files(connection_file: str | os.PathLike) -> None:
    """Remove the connection file, and its folder when mnb made it (``mnb-pool-*``).

    Every rank of the pool races to do this: whatever is already gone is fine.
    """
    path = Path(connection_file)
    try:
        path.unlink()
    except OSError:
        pass
    if path.parent.name.startswith("mnb-pool-"):
        shutil.rmtree(path.parent, ignore_errors=True)


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


def _empty_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _same_host(info: ConnectionInfo) -> bool:
    import socket

    return info.controller_host in (None, socket.gethostname())
