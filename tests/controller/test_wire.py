"""The wire between controller and ranks: routing bound to the signature, size limits,
batched output, control answers from any thread, and ranks that never outlive or
block on a dead controller.  Real sockets and processes throughout."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq

from mnb.controller.transport import STREAM_QUEUE_MAX_CHARS, Transport
from mnb.protocol import MAX_MESSAGE_BYTES, ConnectionInfo, Message, Signer, new_key
from mnb.worker.capture import RankStream
from mnb.worker.channel import Channel, controller_alive
from tests.conftest import alive_pids

# ------------------------------------------------------------------ helpers


def connection(transport_address: str, key: bytes, **fields) -> ConnectionInfo:
    """This process as the controller of a pool of two."""
    fields.setdefault("controller_pid", os.getpid())
    fields.setdefault("controller_started", psutil.Process().create_time())
    return ConnectionInfo(address=transport_address, key=key, world_size=2,
                          controller_host=socket.gethostname(), **fields)


@pytest.fixture
def wire():
    """A Transport and a factory of real Channels connected to it (closed afterwards)."""
    key = new_key()
    transport = Transport(key)
    transport.expect(2)
    channels: list[Channel] = []

    def channel(rank: int = 0) -> Channel:
        made = Channel(connection(transport.address, key), rank, status_fn=lambda: {"pid": os.getpid()})
        channels.append(made)
        return made

    yield transport, key, channel
    for made in channels:
        made.close()
    transport.close()


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def heartbeats_seen(channel: Channel, count: int) -> None:
    """Wait until ``channel`` received ``count`` more controller heartbeats."""
    target = channel.received["heartbeat"] + count
    wait_for(lambda: channel.received["heartbeat"] >= target, what="controller heartbeats")


def dealer(context: zmq.Context, address: str, identity: bytes) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def peak_rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def peak_rss_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


class LineReader:
    """A subprocess's stdout lines, read by a thread so waits can be bounded."""

    def __init__(self, stream):
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put("")

    def until(self, predicate, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if not line:
                raise AssertionError("the process ended before printing the expected line")
            if predicate(line):
                return line


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while alive_pids(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive_pids(pids)


def kill_all(pids: list[int]) -> None:
    for pid in alive_pids(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------ routing


def test_squatters_get_nothing_and_break_nothing(wire):
    transport, key, channel = wire
    context = zmq.Context()
    squatters = [dealer(context, transport.address, f"rank-{r}".encode()) for r in (0, 1)]
    try:
        for sock in squatters:  # they speak first: unsigned junk claiming ranks 0 and 1
            sock.send_multipart([b"0" * 64, b'{"type":"hello","id":"x","rank":0}', b""])
        wait_for(lambda: transport.dropped >= 2, what="the squatters' messages to be dropped")
        real = channel(0)
        transport.send(0, Message("execute", header={"code": "x = 1"}))
        assert real.inbox.get(timeout=30)["code"] == "x = 1"
        answers = transport.ask("status", [0], timeout_s=30)
        assert answers[0]["pid"] == os.getpid()
        assert transport.routes() == {0: real.identity}
        heartbeats_seen(real, 2)  # the controller beat at least twice since the route was known
        for sock in squatters:
            assert sock.poll(0) == 0, "a squatter received something meant for a rank"
    finally:
        for sock in squatters:
            sock.close(0)
        context.term()


def test_messages_wait_for_the_route_then_go(wire):
    transport, key, channel = wire
    transport.send(1, Message("execute", header={"code": "early"}))  # before rank 1 exists
    late = channel(1)
    assert late.inbox.get(timeout=30)["code"] == "early"


def raise_keyboard_interrupt_at(line: int, call) -> bool:
    """Run ``call`` with a KeyboardInterrupt raised at its ``line``-th executed line (any frame),
    as Jupyter's SIGINT may; whether it was raised (False: ``call`` had fewer lines)."""
    seen = 0

    def trace(frame, event, arg):
        nonlocal seen
        if event == "line":
            seen += 1
            if seen == line:
                raise KeyboardInterrupt
        return trace

    sys.settrace(trace)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def test_an_interrupt_anywhere_in_a_send_leaves_the_next_message_whole(wire):
    transport, key, channel = wire
    rank = channel(0)
    transport.send(0, Message("execute", header={"code": "route"}))
    assert rank.inbox.get(timeout=30)["code"] == "route"
    line = 0
    while True:
        line += 1
        hit = raise_keyboard_interrupt_at(
            line, lambda: transport.send(0, Message("execute", header={"code": f"during {line}"})))
        transport.send(0, Message("execute", header={"code": f"after {line}"}))
        codes = []
        while f"after {line}" not in codes:  # a corrupted message is dropped by the rank: this times out
            codes.append(rank.inbox.get(timeout=10)["code"])
        assert set(codes) <= {f"during {line}", f"after {line}"}, codes
        if not hit:  # the send ran to its end uninterrupted: every line was tried
            break
    assert line > 3


def test_a_signed_message_from_another_identity_is_dropped(wire):
    transport, key, channel = wire
    signer, context = Signer(key), zmq.Context()
    impostor = dealer(context, transport.address, b"rank-0")
    try:
        # a replayed message: validly signed, but naming another connection's identity
        impostor.send_multipart(
            signer.encode(Message("heartbeat", header={"rank": 0, "identity": "r0-0123456789abcdef"}))
        )
        wait_for(lambda: transport.dropped == 1, what="the replayed message to be dropped")
        assert transport.routes() == {}
        real = channel(0)
        wait_for(lambda: 0 in transport.routes(), what="rank 0's route")
        # signed and truthful about its identity, but rank 0 already speaks from another one
        impostor.send_multipart(signer.encode(Message("event", header={"rank": 0, "identity": "rank-0"})))
        wait_for(lambda: transport.dropped == 2, what="the second impostor message to be dropped")
        assert transport.routes() == {0: real.identity}
        with pytest.raises(queue.Empty):
            transport.get(timeout=0)
    finally:
        impostor.close(0)
        context.term()


def test_a_restarted_rank_moves_its_route_with_hello(wire):
    transport, key, channel = wire
    old = channel(0)
    wait_for(lambda: transport.routes().get(0) == old.identity, what="the first route")
    new = channel(0)
    new.send(Message("hello", header={"pid": os.getpid()}))
    assert transport.get(timeout=30).type == "hello"
    assert transport.routes() == {0: new.identity}
    transport.send(0, Message("execute", header={"code": "to the new one"}))
    assert new.inbox.get(timeout=30)["code"] == "to the new one"
    assert old.inbox.empty()


# ------------------------------------------------------------------ protocol versions

NEWER_RANK = textwrap.dedent("""
    import sys
    import mnb.protocol
    mnb.protocol.PROTOCOL_VERSION += 1   # this process plays a rank of a newer mnb
    from mnb.worker.main import main
    main(["--connect", sys.argv[1]])
""")


def test_a_rank_of_another_protocol_version_is_refused_by_name(wire, tmp_path):
    """A hand-joined host with another mnb: the rank refuses to join and the controller names both versions;
    an old rank (no check of its own) is refused by the controller from its hello alone."""
    from mnb.controller.generation import hello_refusal
    from mnb.protocol import PROTOCOL_VERSION

    transport, key, channel = wire
    connection_file = connection(transport.address, key).write(tmp_path / "pool.json")
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    newer = subprocess.run([sys.executable, "-c", NEWER_RANK, str(connection_file)], env=env,
                           capture_output=True, text=True, timeout=120)
    assert newer.returncode != 0
    hello = transport.get(timeout=30)
    assert hello.type == "hello" and hello["failed"] and hello["rank"] == 1
    assert hello["protocol_version"] == PROTOCOL_VERSION + 1
    refusal = hello_refusal(hello)
    assert f"rank 1 on {socket.gethostname()} speaks protocol version {PROTOCOL_VERSION + 1}" in refusal
    assert f"speaks protocol version {PROTOCOL_VERSION}: install the same mnb version" in refusal
    # the rank said why too, in its own words (its stderr, and the failed hello's error)
    assert f"speaks protocol version {PROTOCOL_VERSION}, this side" in hello["evalue"]
    assert "ProtocolError" in newer.stderr

    # An older rank, signed by hand: patching mnb.protocol.PROTOCOL_VERSION here instead would also change what
    # the transport's I/O thread decodes against (it reads the same global), and a hello decoded in that
    # window arrived as this version's (CI, 2026-12-04)
    older = zmq.Context.instance().socket(zmq.DEALER)
    older.setsockopt(zmq.IDENTITY, b"r0-older")
    older.setsockopt(zmq.LINGER, 0)
    older.connect(transport.address)
    signer = Signer(key)

    def send(kind: str, version: int, **header) -> None:
        header_bytes = json.dumps(dict(header, type=kind, id="", v=version, rank=0, identity="r0-older")).encode()
        older.send_multipart([signer.sign(header_bytes, b""), header_bytes, b""])

    try:
        send("hello", PROTOCOL_VERSION - 1, pid=os.getpid(), host="node-b")
        send("event", PROTOCOL_VERSION - 1, text="from an older rank")
        send("event", PROTOCOL_VERSION, text="this version's")  # arrives after the older one
        hello = transport.get(timeout=30)
        assert hello_refusal(hello).startswith(
            f"rank 0 on node-b speaks protocol version {PROTOCOL_VERSION - 1}, this side")
        # the older event was dropped, not delivered: the next message the notebook sees is this version's
        assert transport.get(timeout=30)["text"] == "this version's"
    finally:
        older.close()
    assert hello_refusal(Message("hello", header={"rank": 0})) is None  # this version joins


# ------------------------------------------------------------------ size limit

SENDER = textwrap.dedent("""
    import sys, zmq
    from zmq.utils.monitor import recv_monitor_message
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(sys.argv[1])
    header = b'{"type":"hello","id":"x","rank":0,"identity":"x"}'
    sock.send_multipart([b"0" * 64, header, bytes(int(sys.argv[2]))], copy=False)
    if monitor.poll(60000):
        print("disconnected", recv_monitor_message(monitor)["event"], flush=True)
    # every socket closed without lingering, the monitor's too: left to exit, the context's termination
    # waited on the monitor socket's pending events, once for 120 s on CI ("pyzmq-gc send failed")
    context.destroy(linger=0)
""")


def test_an_oversized_frame_is_refused_before_it_is_read(wire):
    transport, key, channel = wire
    size = MAX_MESSAGE_BYTES + 64 * 2**20
    before = transport.dropped
    peak_rss_reset()
    baseline = peak_rss_bytes()
    sender = subprocess.run([sys.executable, "-c", SENDER, transport.address, str(size)],
                            capture_output=True, text=True, timeout=120)
    assert "disconnected" in sender.stdout, sender.stderr  # ZeroMQ closed the connection on the frame header
    assert peak_rss_bytes() - baseline < size // 4  # never buffered
    assert transport.dropped == before  # never reached the signature check either
    real = channel(0)
    assert transport.ask("status", [0], timeout_s=30)[0]["pid"] == os.getpid()
    assert transport.routes() == {0: real.identity}


# ------------------------------------------------------------------ output


def test_text_arrives_before_its_reply_in_few_messages(wire):
    transport, key, channel = wire
    rank = channel(0)
    wait_for(lambda: 0 in transport.routes(), what="rank 0's route")
    stdout, stderr = RankStream("stdout", rank, 0, sys.__stdout__), RankStream("stderr", rank, 0, sys.__stderr__)
    stdout.cell_id = stderr.cell_id = "cell-1"
    for i in range(50_000):
        print(i, file=stdout)
        if i % 10_000 == 0:
            print(f"warning {i}", file=stderr)
    rank.reply(Message("execute", id="cell-1"), ok=True)
    text = {"stdout": [], "stderr": []}
    while (message := transport.get(timeout=30)).type != "reply":
        assert message.type == "stream" and message["cell"] == "cell-1"
        text[message["name"]].append(message["text"])
    assert "".join(text["stdout"]).splitlines() == [str(i) for i in range(50_000)]
    assert "".join(text["stderr"]).splitlines() == [f"warning {i}" for i in range(0, 50_000, 10_000)]
    assert transport.received["stream"] < 50_000 // 10


def test_ask_is_answered_while_another_thread_reads_the_inbox(wire):
    transport, key, channel = wire
    rank = channel(0)
    read: queue.Queue[Message] = queue.Queue()
    reader = threading.Thread(target=lambda: read.put(transport.get(timeout=60)))
    reader.start()  # a "cell" blocked on the inbox
    answers = transport.ask("stacks", [0], timeout_s=30)
    assert "stacks" in answers[0].header
    assert reader.is_alive() and read.empty()  # the answer did not go through the inbox
    rank.send(Message("event", header={"kind": "progress"}, payload={"step": 1}))
    reader.join(timeout=30)
    assert read.get_nowait().payload == {"step": 1}
    with pytest.raises(ValueError, match="status"):
        transport.ask("execute", [0], 1)


def test_stream_text_queued_per_cell_is_bounded(wire):
    transport, key, channel = wire
    rank = channel(0)
    line = "x" * 1023 + "\n"
    lines = (STREAM_QUEUE_MAX_CHARS * 2) // len(line)
    for _ in range(lines):
        rank.write_stream("stdout", line, "flood")
    rank.write_stream("stdout", "small\n", "other")
    assert transport.ask("status", [0], timeout_s=60)  # answered after everything queued before it
    kept = {"flood": 0, "other": 0}
    while True:
        try:
            message = transport.get(timeout=0)
        except queue.Empty:
            break
        kept[message["cell"]] += message["text"].count("\n")
    dropped = transport.take_dropped("flood")
    assert 0 < kept["flood"] * len(line) <= STREAM_QUEUE_MAX_CHARS
    assert kept["flood"] + dropped == lines
    assert kept["other"] == 1 and transport.take_dropped("other") == 0
    assert transport.take_dropped("flood") == 0  # taken once


# ------------------------------------------------------------------ dead controller


def test_controller_alive_tells_the_controller_from_a_zombie_or_a_reused_pid():
    me = psutil.Process()
    assert controller_alive(me.pid, me.create_time())
    assert controller_alive(me.pid, None)
    assert not controller_alive(me.pid, me.create_time() - 3600)  # same PID, another process
    child = subprocess.Popen(["true"])
    wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, what="a zombie")
    assert not controller_alive(child.pid, None)
    child.wait()
    assert not controller_alive(child.pid, None)


RANK = textwrap.dedent("""
    import json, subprocess, sys, time
    from mnb.protocol import ConnectionInfo, Message
    from mnb.worker.channel import Channel
    channel = Channel(ConnectionInfo.read(sys.argv[1]), 0, status_fn=dict)
    child = subprocess.Popen(["sleep", "300"])
    line = "x" * 1023 + "\\n"
    for _ in range(256 * 1024):            # 256 MiB of output nobody reads
        channel.write_stream("stdout", line, "c")
    channel.send(Message("event", header={"kind": "progress"}, payload=b"y" * 2**20))
    deadline = time.monotonic() + 120
    while not channel.dropped_stream_chars and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"child": child.pid, "dropped": channel.dropped_stream_chars}), flush=True)
    time.sleep(600)
""")


def test_a_flooded_rank_never_blocks_and_leaves_nothing_when_its_controller_dies(tmp_path):
    controller = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with socket.socket() as probe:  # an address where nothing listens: nothing will ever be read
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    folder = tmp_path / "mnb-pool-test"
    folder.mkdir()
    (folder / "torchrun.log").write_text("log\n")
    info = ConnectionInfo(address=address, key=new_key(), world_size=1, controller_pid=controller.pid,
                          controller_host=socket.gethostname(),
                          controller_started=psutil.Process(controller.pid).create_time())
    path = info.write(folder / "pool.json")
    errors = tmp_path / "rank.err"
    with errors.open("w") as stderr:
        rank = subprocess.Popen([sys.executable, "-c", RANK, str(path)], stdout=subprocess.PIPE,
                                stderr=stderr, text=True)
    pids = [rank.pid]
    try:
        report = json.loads(LineReader(rank.stdout).until(lambda line: line.startswith("{"), 180))
        pids.append(report["child"])
        assert report["dropped"] > 0  # the backlog is bounded: old text went, the writer never waited
        assert alive_pids(pids) == pids
        os.kill(controller.pid, signal.SIGKILL)  # not reaped: a zombie under its old PID
        assert rank.wait(timeout=15) == 0
        assert "controller is gone (exited)" in errors.read_text()
        assert wait_gone(pids, 5) == []
        assert not folder.exists()
    finally:
        kill_all(pids)
        controller.kill()
        controller.wait()


CONTROLLER = textwrap.dedent("""
    import json
    from mnb.controller import Pool
    pool = Pool.start(2, device="cpu", timeout=180)
    pool.run("import subprocess, time\\nchild = subprocess.Popen(['sleep', '300']).pid", quiet=True)
    children = list(pool.pull("child").values())
    print(json.dumps({"pids": pool.pids(), "children": children, "workdir": str(pool.workdir())}), flush=True)
    pool.run("print('sleeping', flush=True)\\ntime.sleep(600)")
""")


@pytest.mark.slow
def test_a_zombie_controller_leaves_no_rank_child_or_file_behind():
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        lines = LineReader(controller.stdout)
        started = json.loads(lines.until(lambda line: line.startswith("{"), 240))
        pids = started["pids"] + started["children"]
        workdir = Path(started["workdir"])
        assert workdir.name.startswith("mnb-pool-") and workdir.exists()
        lines.until(lambda line: "sleeping" in line, 60)  # both ranks are inside a long call now
        assert alive_pids(pids) == pids
        os.kill(controller.pid, signal.SIGKILL)  # no atexit, and no wait(): it stays a zombie
        wait_for(lambda: psutil.Process(controller.pid).status() == psutil.STATUS_ZOMBIE, 5, what="a zombie")
        left = wait_gone(pids, 10)  # 5 s by design; margin for a loaded machine
        assert left == [], f"left behind: {left}"
        wait_for(lambda: not workdir.exists(), 5, what="the pool folder to be removed")
    finally:
        kill_all(pids)
        controller.kill()
        controller.wait()


@pytest.mark.slow
def test_two_hundred_thousand_lines_arrive_complete_and_in_order(tmp_path, capsys):
    from mnb.controller import Pool

    pool = Pool.start(2, device="cpu", timeout=180, workdir=tmp_path)
    try:
        before = pool._transport.received["stream"]
        pool.run("for i in range(200_000):\n    print(f'{rank}:{i}')", timeout=300)
        streams = pool._transport.received["stream"] - before
        out = capsys.readouterr().out
    finally:
        pool.stop()
    texts = [line.split("] ", 1)[1] for line in out.splitlines() if line.startswith("[")]
    for rank in (0, 1):
        mine = [text for text in texts if text.startswith(f"{rank}:")]
        assert len(mine) == 200_000
        assert mine[0] == f"{rank}:0" and mine[-1] == f"{rank}:199999"
        assert mine == [f"{rank}:{i}" for i in range(200_000)]
    assert streams < 400_000 // 20, f"{streams} stream messages for 400,000 prints"
