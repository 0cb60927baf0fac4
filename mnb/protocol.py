"""The one message protocol between the notebook controller and the ranks.

Wire format, modelled on Jupyter's own (HMAC-signed multipart messages):

    [signature, header, payload]

``header`` is UTF-8 JSON with at least ``type`` and ``id``; ``payload`` is a
pickle of Python values (``b""`` when there are none).  ``signature`` is the
hex HMAC-SHA256 of ``header + payload`` under the pool's secret key.  A
message whose signature does not verify is dropped before anything in it is
unpickled, and logged: only holders of the connection file (mode 0600) can
make a rank run code.  No frame may exceed :data:`MAX_MESSAGE_BYTES`: both
sockets set ``zmq.MAXMSGSIZE`` so ZeroMQ refuses a bigger frame from its
header, before reading it, and :meth:`Signer.encode` refuses to build one.

Every rank -> controller header carries ``rank`` and ``identity``, the random
ZeroMQ routing identity of the rank's socket, inside the signed header: the
controller routes to a rank only through the identity its first valid
message proved, so an unsigned connection that claims a rank's name gets
nothing.

Message types (``header["type"]``) and the fields each carries (header fields, then payload).
Every header also carries ``v``, the sender's :data:`PROTOCOL_VERSION`; a message of another version
is dropped, except a ``hello``, which arrives with ``protocol_version`` set so that the rank is refused
by name (:func:`version_mismatch`).

controller -> rank
    execute    run a cell: number (the cell's ``<cell-N>``: the controller counts, every rank shows the
               same), code (none: only the layout), display_ranks, want_value, show_result; layout (a
               ParallelConfig dict) when the cell changes it; kernel (the notebook's cwd and environment
               changes, ``controller/kernel_context.py``); profile (``%%megatron --profile``: steps,
               folder, options); debug_ranks (ranks whose ``input()``/pdb reach the notebook); script
               {path, args} and ranks for ``%mnb run``; after_script to rebuild the pool's layout after
               one; post_mortem (``%mnb debug``: pdb in the last failed cell's frames)
    push       bind names: encoded; payload {name: pickle of its value} (``values.encode_push``)
    pull       read names: names; the reply's payload is one kernel-safe pickle per name
    status     answered from the rank's I/O thread, also while a cell runs
    stacks     the Python stack of the rank's main thread from the cell down (for hangs), from the
               I/O thread
    interrupt  a real SIGINT to the running cell, from the I/O thread
    heartbeat  the controller is alive; ranks exit when these stop
    shutdown   leave the exec loop and exit (a standby rank exits at once)
    go         a standby rank (torch imported, before CUDA and the process group) starts and says hello
    input_reply  the answer to an ``input_request`` (same id), from the I/O thread to the waiting
               thread: value (the line typed, no newline), or error (``no-stdin``: the front-end
               has no stdin; ``eof``: the user ended input; ``interrupt``: the cell is being
               stopped) with text saying why

rank -> controller (every header also has rank and identity)
    hello      world_size, local_rank, node_rank, pid, host, device, device_name, backend, coords,
               layout, torch and megatron versions, startup (the start's stage intervals), starting
               (what the start still does after the hello, e.g. "importing Megatron-Core, 2.0 s so far";
               "" when nothing: ``mnb/worker/late_start.py``); a rank whose start failed sends pid and
               failed instead
    stream     name (stdout/stderr), text, cell (the execute's id), batched every 20 ms
    display    cell; payload: a MIME bundle to show in the notebook
    event      kind (e.g. "progress"), cell; payload: the event (``mnb.progress.Progress``); "starting"
               {doing, elapsed_s}: the cell waits for the rank's start (Megatron-Core's import), and
               "started" {waited_s} once that wait is over
    reply      the answer to a request (same id): ok, and ename, evalue, traceback when not;
               execute: coords, layout, profile_dir (the folder the rank wrote the cell's profile
               to, or None), kept (``post_mortem``: whether the rank kept a failure to debug),
               payload {value, records (the run records)};
               status: pid, device, rss_bytes, memory_bytes (memory_reserved_bytes on CUDA),
               layout, busy, starting (while the start goes on after the hello); stacks: stacks, busy; interrupt: interrupted, deferred
    heartbeat  the rank is alive (its state travels in status and stacks answers)
    standby    a standby rank imported torch and waits for ``go``: pid, host
    fatal      a rank's last words before it exits on a failure outside any request (its start after
               the hello: Megatron-Core's import or the default layout): doing, ename, evalue, traceback
    input_request  a cell on the rank called ``input()``/``getpass``/pdb: prompt, password, cell;
               the controller asks the notebook's stdin (labelled with the rank) and sends an
               ``input_reply`` with the same id
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import os
import pickle
import secrets
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mnb.units import MIB, format_mib
from mnb.errors import MessageTooLarge, ProtocolError  # noqa: F401 - defined in mnb.errors; this import path kept
from mnb.version import __version__

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 2
"""The wire format's version: every header carries it, the connection file too.  A rank and a
controller of different versions refuse each other by name (:func:`version_mismatch`) instead of
failing later on a missing field.  2: ``execute`` carries the cell's ``number``."""

MAX_MESSAGE_BYTES = 256 * MIB
"""The largest message (header + payload) either side builds or accepts."""

EXITS_DIR_ENV = "MNB_EXITS_DIR"
"""The folder (set by the controller's launcher) where torchrun's agent, ``mnb.worker.agent``,
records how failed ranks ended, and where each rank's Python fault handler writes its stacks when
it crashes (:func:`fault_file`): the one other thing besides messages that crosses the sides."""

STANDBY_ENV = "MNB_STANDBY"
"""Set to 1 by the controller in a standby generation's environment (:mod:`mnb.controller.standby`): its
ranks import torch, say ``standby`` and wait for a signed ``go`` before CUDA or any process group, their
Megatron-Core import going on meanwhile (:mod:`mnb.worker.boot`)."""


def fault_file(exits_dir: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` writes every thread's Python stack if a signal kills it (SIGSEGV, SIGABRT...):
    a crashed process sends no message, so the controller reads this file for its death report."""
    return Path(exits_dir) / f"fault-rank{rank}.txt"

CONTROLLER_TYPES = frozenset(
    {"execute", "push", "pull", "status", "stacks", "interrupt", "heartbeat", "shutdown", "go", "input_reply"}
)
"""``go`` releases a standby rank (torch imported, waiting before CUDA and the process group) into its start."""
RANK_TYPES = frozenset({"hello", "stream", "display", "event", "reply", "heartbeat", "standby", "input_request",
                        "fatal"})
"""``standby``: a standby rank imported torch and waits for ``go`` (its pid, host); ``fatal``: a rank's last
words before it exits (the transport keeps them for the death report)."""
MESSAGE_TYPES = CONTROLLER_TYPES | RANK_TYPES


def version_mismatch(theirs: Any, who: str) -> str | None:
    """The refusal when ``who`` speaks protocol ``theirs`` and this side :data:`PROTOCOL_VERSION`;
    ``None`` when they agree.  The one wording both sides use."""
    if theirs == PROTOCOL_VERSION:
        return None
    spoken = "no protocol version" if theirs is None else f"protocol version {theirs}"
    return (f"{who} speaks {spoken}, this side (mnb {__version__}) speaks protocol version "
            f"{PROTOCOL_VERSION}: install the same mnb version on every host of the pool")





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
    """Signs and verifies frames with HMAC-SHA256 under one pool's key.

    ``loads`` rebuilds payloads; the notebook side passes
    :func:`mnb.values.loads_safe`, so no payload can import torch (or anything
    else) into the kernel.  A signed message whose payload cannot be rebuilt is
    still delivered, with ``payload=None`` and the reason in its header's
    ``payload_error``: its sender is waiting for an answer.
    """

    def __init__(self, key: bytes, loads: Callable[[bytes], Any] = pickle.loads):
        if not key:
            raise ValueError("an empty key would let anyone run code on the ranks")
        self._key = key
        self._loads = loads

    def sign(self, *frames: bytes) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for frame in frames:
            mac.update(frame)
        return mac.hexdigest().encode()

    def encode(self, message: Message) -> list[bytes]:
        """The signed frames of ``message``; :class:`MessageTooLarge` past :data:`MAX_MESSAGE_BYTES`."""
        if message.type not in MESSAGE_TYPES:
            raise ProtocolError(f"unknown message type {message.type!r}")
        header = dict(message.header, type=message.type, id=message.id, v=PROTOCOL_VERSION)
        header_bytes = json.dumps(header, separators=(",", ":"), default=str).encode()
        room = MAX_MESSAGE_BYTES - len(header_bytes)
        if room < 0:
            raise MessageTooLarge(message.type, len(header_bytes), MAX_MESSAGE_BYTES)
        payload, size = (b"", 0) if message.payload is None else _pickle_within(message.payload, room)
        if payload is None:  # over the limit: measured without keeping the bytes
            raise MessageTooLarge(message.type, len(header_bytes) + size, MAX_MESSAGE_BYTES)
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
        version = header.pop("v", None)
        if version != PROTOCOL_VERSION:
            if kind != "hello":  # only a hello is read across versions, to be refused by name
                raise ProtocolError(version_mismatch(version, f"a {kind!r} message"))
            header["protocol_version"] = version
        try:
            value = self._loads(payload) if payload else None
        except Exception as exc:  # signed, so its sender is ours: deliver it, saying why it is empty
            header["payload_error"] = f"{type(exc).__name__}: {exc}"
            value = None
        return Message(type=kind, id=msg_id, header=header, payload=value)


class _CappedBuffer(io.BytesIO):
    """A pickle target that stops keeping bytes past ``limit`` (then only counts them)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.size = 0
        self.over = False

    def write(self, data: Any) -> int:
        count = memoryview(data).nbytes
        self.size += count
        if not self.over and self.size > self.limit:
            self.over = True
            self.seek(0)
            self.truncate()  # release what was kept: the message will not be sent
        if not self.over:
            super().write(data)
        return count


def _pickle_within(value: Any, limit: int) -> tuple[bytes | None, int]:
    """``(pickle.dumps(value), size)``, or ``(None, size)`` past ``limit`` bytes, never holding more."""
    buffer = _CappedBuffer(limit)
    pickle.Pickler(buffer, protocol=5).dump(value)
    return (None if buffer.over else buffer.getvalue()), buffer.size


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
    controller_started: float | None = None
    """The controller process's start time (``psutil.Process().create_time()``), so a
    rank on the same host can tell its controller from a later process with the same PID."""
    protocol_version: int | None = PROTOCOL_VERSION
    """The controller's :data:`PROTOCOL_VERSION` (as the file says; a rank checks it before it joins)."""
    path: str | None = field(default=None, compare=False)
    """Where :meth:`read` found this file (ranks remove it when their controller is gone)."""

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
            "controller_started": self.controller_started,
            "protocol_version": self.protocol_version,
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
            controller_started=data.get("controller_started"),
            protocol_version=data.get("protocol_version"),
            path=str(path),
        )
