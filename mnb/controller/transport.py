"""The controller's end of the protocol: one ROUTER socket, one I/O thread.

The thread owns the socket (ZeroMQ sockets are not thread-safe), verifies
every incoming message, drops and logs forged ones before unpickling
anything, keeps each rank's last heartbeat, sends the controller's own
heartbeat (ranks exit when it stops), and hands every other message to the
notebook thread through :meth:`Transport.get` (the :attr:`Transport.inbox`).

Routing is bound to the signature: a rank's socket has a random ZeroMQ
identity, and every message it sends names that identity in its signed
header.  The first valid message of rank ``r`` whose header identity equals
the identity ZeroMQ saw fixes the route to ``r`` (a later valid ``hello``
may move it, for a restarted rank); anything else claiming ``r`` is dropped.
A connection that merely calls itself ``rank-0`` therefore gets nothing and
breaks nothing.  Messages for a rank whose route is not known yet wait in a
short per-rank list until its first heartbeat arrives.

Replies to :meth:`Transport.ask` (``status``/``stacks``/``interrupt``) go to
a queue private to that call, never through the inbox, so a thread may ask
while another is blocked reading the inbox.  Stream text queued in the
inbox is bounded per cell (:data:`STREAM_QUEUE_MAX_CHARS`); past it, the
cell's stream messages are dropped on arrival and their lines counted
(:meth:`Transport.take_dropped`).
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from typing import Any, Iterable

import zmq

from mnb.controller.guards import interrupts_held
from mnb.protocol import MAX_MESSAGE_BYTES, Message, ProtocolError, Signer, drain
from mnb.timeouts import HEARTBEAT_INTERVAL_S
from mnb.values import loads_safe

log = logging.getLogger(__name__)

STREAM_QUEUE_MAX_CHARS = 16 * 2**20
"""Characters of stream text of one cell waiting in the inbox; more is dropped (and counted) on arrival."""
PENDING_PER_RANK = 64
"""Messages kept for a rank whose route is not known yet (the oldest go first)."""
ASK_TYPES = frozenset({"status", "stacks", "interrupt"})


class _Inbox(queue.Queue):
    """The notebook's queue of rank messages, counting the stream text it holds per cell."""

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self.stream_chars: dict[Any, int] = {}

    def _put(self, item: Message) -> None:
        if item.type == "stream":
            cell = item.get("cell")
            self.stream_chars[cell] = self.stream_chars.get(cell, 0) + len(item.get("text") or "")
        super()._put(item)

    def _get(self) -> Message:
        item = super()._get()
        if item.type == "stream":
            cell = item.get("cell")
            left = self.stream_chars.get(cell, 0) - len(item.get("text") or "")
            if left > 0:
                self.stream_chars[cell] = left
            else:
                self.stream_chars.pop(cell, None)
        return item

    def queued_stream_chars(self, cell: Any) -> int:
        with self.mutex:
            return self.stream_chars.get(cell, 0)


class Transport:
    def __init__(self, key: bytes, ip: str = "127.0.0.1"):
        self._signer = Signer(key, loads=loads_safe)
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        port = self._router.bind_to_random_port(f"tcp://{ip}")
        self.address = f"tcp://{ip}:{port}"
        # Outgoing messages: a deque any thread appends to, and a pipe byte that wakes the I/O
        # thread.  Neither takes a lock nor a socket, so Jupyter's interrupt (KeyboardInterrupt
        # at almost any bytecode) can neither leave half a multipart message for the next send
        # to extend nor leave a lock held (CPython can raise between a ``with lock`` and its body).
        self._outbox: collections.deque[tuple[int, list[bytes]]] = collections.deque()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self.inbox: _Inbox = _Inbox()
        self.last_heartbeat: dict[int, float] = {}
        self.last_words: dict[int, Message] = {}
        """Each rank's ``fatal`` message, sent before it exits on a failure outside any request (its start
        after the hello): kept here, never queued, for the death report (``reports.last_words``)."""
        self.known_ranks: set[int] = set()  # ranks with a route (their first valid message arrived)
        self.dropped = 0
        self.received: collections.Counter[str] = collections.Counter()
        self._world_size: int | None = None
        self._routes: dict[int, bytes] = {}
        self._pending: dict[int, collections.deque[list[bytes]]] = {}
        self._waiters: dict[str, queue.Queue[Message]] = {}
        self._asked: collections.deque[str] = collections.deque(maxlen=256)
        self._dropped_lines: dict[Any, int] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mnb-controller-io", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- public
    def expect(self, world_size: int) -> None:
        """The pool's size: messages claiming a rank outside ``range(world_size)`` are dropped."""
        self._world_size = world_size

    def routes(self) -> dict[int, bytes]:
        """The ZeroMQ identity each rank proved (a copy)."""
        return dict(self._routes)

    def seal(self, message: Message) -> list[bytes]:
        """``message``'s signed frames, the same for every rank (routing adds the identity): built once for a
        request to many ranks.  :class:`~mnb.errors.MessageTooLarge` past the protocol's limit, nothing queued."""
        return self._signer.encode(message)

    def send(self, rank: int, message: Message) -> None:
        """Queue ``message`` for ``rank``; safe from any thread.  Held until the rank's route is known."""
        self.send_sealed(rank, self.seal(message))

    def send_sealed(self, rank: int, frames: list[bytes]) -> None:
        """Queue frames :meth:`seal` built for ``rank``, as :meth:`send` does."""
        self._outbox.append((rank, frames))
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups: the I/O thread is about to empty the outbox
            pass
        except OSError:  # closed: the transport is gone, as its ranks are
            pass

    def get(self, timeout: float | None = None) -> Message:
        """The next message for the notebook (raises :class:`queue.Empty` after ``timeout`` s)."""
        return self.inbox.get(timeout=timeout)

    def take_dropped(self, cell_id: Any) -> int:
        """Lines of ``cell_id``'s output dropped because too much was queued; resets the count."""
        with interrupts_held(), self._lock:
            return self._dropped_lines.pop(cell_id, 0)

    def ask(self, kind: str, ranks: Iterable[int], timeout_s: float) -> dict[int, Message]:
        """Send one ``status``/``stacks``/``interrupt`` to ``ranks``; ``{rank: reply}`` of those that
        answered within ``timeout_s``.  Safe from any thread, also while another reads the inbox.

        An interrupt is held until the answers are in (at most ``timeout_s``): taken inside,
        it could leave the lock or the reply queue's mutex held, and the I/O thread would
        block on it for good."""
        if kind not in ASK_TYPES:
            raise ValueError(f"ask sends one of {sorted(ASK_TYPES)}, not {kind!r}")
        with interrupts_held():
            return self._ask(Message(kind, header={}), set(ranks), timeout_s)

    def _ask(self, message: Message, targets: set[int], timeout_s: float) -> dict[int, Message]:
        answers: dict[int, Message] = {}
        if not targets:
            return answers
        replies: queue.Queue[Message] = queue.Queue()
        with self._lock:
            self._waiters[message.id] = replies
        try:
            for rank in sorted(targets):
                self.send(rank, message)
            deadline = time.monotonic() + timeout_s
            while len(answers) < len(targets):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    reply = replies.get(timeout=remaining)
                except queue.Empty:
                    break
                if reply.get("rank") in targets:
                    answers[reply["rank"]] = reply
        finally:
            with self._lock:
                del self._waiters[message.id]
                self._asked.append(message.id)  # late answers are dropped, not put in the inbox
        return answers

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=2)
        self._router.close(linger=0)
        self._context.term()
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)

    # --------------------------------------------------------- I/O thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        next_beat = 0.0
        while not self._closing.is_set():
            try:
                events = dict(poller.poll(200))
            except zmq.ZMQError:
                break
            if self._wake_read in events:
                try:
                    while os.read(self._wake_read, 4096):
                        pass
                except OSError:  # empty (BlockingIOError), or closed by close()
                    pass
            while self._outbox:  # also what an interrupted send queued without its wake-up
                self._forward(*self._outbox.popleft())
            if self._router in events:
                drain(self._router, self._receive)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_INTERVAL_S
                beat = self._signer.encode(Message("heartbeat"))
                for identity in list(self._routes.values()):
                    self._send_to(identity, beat)

    def _send_to(self, identity: bytes, frames: list[bytes]) -> None:
        try:  # a ROUTER drops (never blocks) when a peer's queue is full or the peer is gone
            self._router.send_multipart([identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # e.g. host unreachable: the rank is gone, its death is reported elsewhere
            log.debug("send failed: %s", exc)

    def _forward(self, rank: int, body: list[bytes]) -> None:
        identity = self._routes.get(rank)
        if identity is not None:
            self._send_to(identity, body)
            return
        pending = self._pending.setdefault(rank, collections.deque())
        if len(pending) >= PENDING_PER_RANK:
            pending.popleft()
            log.warning("rank %d has not connected; dropped its oldest waiting message", rank)
        pending.append(body)

    def _receive(self, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        try:
            message = self._signer.decode(body)
        except ProtocolError as exc:
            self._drop("dropped a message from %r: %s", identity[:32], exc)
            return
        rank, claimed = message.get("rank"), message.get("identity")
        if (
            not isinstance(rank, int)
            or not isinstance(claimed, str)
            or claimed.encode() != identity
            or (self._world_size is not None and not 0 <= rank < self._world_size)
        ):
            self._drop("dropped a message whose rank %r / identity %r does not match its sender %r",
                       rank, claimed, identity[:32])
            return
        route = self._routes.get(rank)
        if route != identity:
            if route is not None and message.type != "hello":
                self._drop("dropped a message for rank %r from %r: the rank speaks from %r",
                           rank, identity[:32], route[:32])
                return
            self._learn_route(rank, identity)
        self.received[message.type] += 1
        self.last_heartbeat[rank] = time.monotonic()
        if message.type == "heartbeat":
            return
        if message.type == "fatal":
            self.last_words[rank] = message
            return
        if message.type == "reply":
            with self._lock:
                waiter = self._waiters.get(message.id)
                late = waiter is None and message.id in self._asked
            if waiter is not None:
                waiter.put(message)
                return
            if late:
                return
        if message.type == "stream" and not self._room_for(message):
            return
        self.inbox.put(message)

    def _learn_route(self, rank: int, identity: bytes) -> None:
        if rank in self._routes:
            log.info("rank %d reconnected as %r", rank, identity[:32])
        self._routes[rank] = identity
        self.known_ranks.add(rank)
        for body in self._pending.pop(rank, ()):
            self._send_to(identity, body)

    def _room_for(self, message: Message) -> bool:
        cell, text = message.get("cell"), message.get("text") or ""
        if self.inbox.queued_stream_chars(cell) + len(text) <= STREAM_QUEUE_MAX_CHARS:
            return True
        with self._lock:
            if cell not in self._dropped_lines:
                log.warning("output of cell %s arrives faster than it is shown; dropping the excess", cell)
            self._dropped_lines[cell] = self._dropped_lines.get(cell, 0) + (text.count("\n") or 1)
        return False

    def _drop(self, reason: str, *args: Any) -> None:
        self.dropped += 1
        log.warning(reason, *args)
