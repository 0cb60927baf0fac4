"""The one message protocol between the notebook controller and the ranks.

Wire format, modelled on Jupyter's own (HMAC-signed multipart messages):

    [signature, header, payload]

``header`` is UTF-8 JSON with at least ``type`` and ``id``; ``payload`` is a
pickle of Python values (``b""`` when there are none).  ``signature`` is the
hex HMAC-SHA256 of ``header + payload`` under the pool's secret key.  A
message whose signature does not verify is dropped before anything in it is
unpickled, and logged: only holders of the connection file (mode 0600) can
make a rank run code.

Message types (``header["type"]``):

controller -> rank
    execute    run a cell: code, layout (or None), display (bool)
    push       bind names in the rank's namespace (payload: dict)
    pull       read names from the rank's namespace
    status     memory and state, answered from the rank's I/O thread
    stacks     Python stacks of the rank's threads (for hangs)
    interrupt  raise KeyboardInterrupt in the running cell
    heartbeat  the controller is alive; ranks exit when these stop
    shutdown   leave the exec loop and exit

rank -> controller
    hello      rank, pid, host, device, backend, coordinates
    stream     stdout/stderr text of a running cell
    display    a MIME bundle to show in the notebook
    event      progress of a training run and other rank-side events
    reply      the answer to execute/push/pull/status/stacks (same id)
    heartbeat  the rank is alive, with its state (idle/busy)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import pickle
import secrets
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1

CONTROLLER_TYPES = frozenset(
    {"execute", "push", "pull", "status", "stacks", "interrupt", "heartbeat", "shutdown"}
)
RANK_TYPES = frozenset({"hello", "stream", "display", "event", "reply", "heartbeat"})
MESSAGE_TYPES = CONTROLLER_TYPES | RANK_TYPES


class ProtocolError(Exception):
    """A message that is malformed, of an unknown type, or wrongly signed."""


@dataclass
class Message:
    """One decoded message: a JSON-able header and an optional Python payload."""

    type: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    header: dict[str, Any] = field(default_factory=dict)
    payload: Any = None

    def __getitem__(self, key: str) -> Any:
        return self.header[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.get(key, default)


def new_key() -> bytes:
    """A fresh per-pool secret (32 random bytes, hex-encoded like Jupyter's)."""
    return secrets.token_hex(32).encode()


class Signer:
    """Signs and verifies frames with HMAC-SHA256 under one pool's key."""

    def __init__(self, key: bytes):
        if not key:
            raise ValueError("an empty key would let anyone run code on the ranks")
        self._key = key

    def sign(self, *frames: bytes) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for frame in frames:
            mac.update(frame)
        return mac.hexdigest().encode()

    def encode(self, message: Message) -> list[bytes]:
        if message.type not in MESSAGE_TYPES:
            raise ProtocolError(f"unknown message type {message.type!r}")
        header = dict(message.header, type=message.type, id=message.id, v=PROTOCOL_VERSION)
        header_bytes = json.dumps(header, separators=(",", ":"), default=str).encode()
        payload = b"" if message.payload is None else pickle.dumps(message.payload, protocol=5)
        return [self.sign(header_bytes, payload), header_bytes, payload]

    def decode(self, frames: list[bytes]) -> Message:
        if len(frames) != 3:
            raise ProtocolError(f"expected 3 frames, got {len(frames)}")
        signature, header_bytes, payload = frames
        if not hmac.compare_digest(signature, self.sign(header_bytes, payload)):
            raise ProtocolError("bad signature")
        try:
            header = json.loads(header_bytes)
        except ValueError as exc:
            raise ProtocolError(f"header is not JSON: {exc}") from None
        kind = header.pop("type", None)
        if kind not in MESSAGE_TYPES:
            raise ProtocolError(f"unknown message type {kind!r}")
        msg_id = header.pop("id", "")
        header.pop("v", None)
        value = pickle.loads(payload) if payload else None
        return Message(type=kind, id=msg_id, header=header, payload=value)


def drain(socket: Any, handle: Any) -> None:
    """Pass every multipart message waiting on a ZeroMQ ``socket`` to ``handle``, without blocking.

    Both sides' I/O threads wake from a poll and empty each ready socket with this.
    """
    import zmq

    while True:
        try:
            frames = socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        handle(frames)


@dataclass(frozen=True)
class ConnectionInfo:
    """What a rank needs to join a pool: the controller's address and the key."""

    address: str
    key: bytes
    world_size: int
    controller_pid: int | None = None
    controller_host: str | None = None

    def write(self, path: str | os.PathLike) -> Path:
        """Write the connection file with mode 0600 (it holds the secret)."""
        path = Path(path)
        data = {
            "address": self.address,
            "key": self.key.decode(),
            "signature_scheme": "hmac-sha256",
            "world_size": self.world_size,
            "controller_pid": self.controller_pid,
            "controller_host": self.controller_host,
            "protocol_version": PROTOCOL_VERSION,
        }
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: str | os.PathLike) -> "ConnectionInfo":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"connection file {path} not found; copy it from the notebook machine "
                "(the path is printed by %mnb start)"
            ) from None
        return cls(
            address=data["address"],
            key=data["key"].encode(),
            world_size=int(data["world_size"]),
            controller_pid=data.get("controller_pid"),
            controller_host=data.get("controller_host"),
        )
