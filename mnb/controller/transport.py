"""The controller's end of the protocol: one ROUTER socket, one I/O thread.

The thread owns the socket (ZeroMQ sockets are not thread-safe), verifies
every incoming message, drops and logs forged ones before unpickling
anything, keeps each rank's last heartbeat, sends the controller's own
heartbeat (ranks exit when it stops), and hands every other message to the
notebook thread through :attr:`Transport.inbox`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import zmq

from mnb.protocol import Message, ProtocolError, Signer, drain

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0


class Transport:
    def __init__(self, key: bytes, ip: str = "127.0.0.1"):
        self._signer = Signer(key)
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        port = self._router.bind_to_random_port(f"tcp://{ip}")
        self.address = f"tcp://{ip}:{port}"
        self._outbox_addr = f"inproc://mnb-controller-{id(self)}"
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(self._outbox_addr)
        self._push = self._context.socket(zmq.PUSH)
        self._push.connect(self._outbox_addr)
        self._push_lock = threading.Lock()
        self.inbox: "queue.Queue[Message]" = queue.Queue()
        self.last_heartbeat: dict[int, float] = {}
        self.busy: dict[int, bool] = {}
        self.known_ranks: set[int] = set()
        self.dropped = 0
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mnb-controller-io", daemon=True)
        self._thread.start()

    def expect(self, world_size: int) -> None:
        """Heartbeat every rank of the pool from the start, before its hello arrives."""
        self.known_ranks.update(range(world_size))

    def send(self, rank: int, message: Message) -> None:
        frames = [f"rank-{rank}".encode(), *self._signer.encode(message)]
        with self._push_lock:
            self._push.send_multipart(frames)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        next_beat = 0.0
        while not self._closing.is_set():
            try:
                events = dict(poller.poll(200))
            except zmq.ZMQError:
                break
            if self._pull in events:
                drain(self._pull, self._forward)
            if self._router in events:
                drain(self._router, self._receive)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_INTERVAL_S
                beat = self._signer.encode(Message("heartbeat"))
                for rank in list(self.known_ranks):
                    self._router.send_multipart([f"rank-{rank}".encode(), *beat])

    def _forward(self, frames: list[bytes]) -> None:
        try:
            self._router.send_multipart(frames)
        except zmq.ZMQError as exc:  # e.g. host unreachable: the rank is gone, its death is reported elsewhere
            log.debug("send failed: %s", exc)

    def _receive(self, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        try:
            message = self._signer.decode(body)
        except ProtocolError as exc:
            self.dropped += 1
            log.warning("dropped a message from %r: %s", identity[:32], exc)
            return
        rank = message.get("rank")
        if not isinstance(rank, int) or identity != f"rank-{rank}".encode():
            self.dropped += 1
            log.warning("dropped a message whose rank %r does not match its sender %r", rank, identity[:32])
            return
        self.last_heartbeat[rank] = time.monotonic()
        if message.type == "heartbeat":
            self.busy[rank] = bool(message.get("busy"))
            return
        if message.type == "hello":
            self.known_ranks.add(rank)
        self.inbox.put(message)

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=2)
        for sock in (self._router, self._pull, self._push):
            sock.close(linger=0)
        self._context.term()
