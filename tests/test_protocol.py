import json
import os
import stat

import psutil
import pytest

from mnb.protocol import (
    MAX_MESSAGE_BYTES,
    ConnectionInfo,
    Message,
    MessageTooLarge,
    ProtocolError,
    Signer,
    new_key,
)


def test_round_trip_keeps_header_and_payload():
    signer = Signer(new_key())
    message = Message("execute", header={"code": "x = 1", "rank": 0}, payload={"a": [1, 2]})
    decoded = signer.decode(signer.encode(message))
    assert decoded.type == "execute"
    assert decoded.id == message.id
    assert decoded["code"] == "x = 1"
    assert decoded.payload == {"a": [1, 2]}


def test_forged_signature_is_rejected_before_unpickling():
    signer, other = Signer(new_key()), Signer(new_key())
    frames = other.encode(Message("execute", header={"code": "import os"}))
    with pytest.raises(ProtocolError, match="bad signature"):
        signer.decode(frames)
    frames = signer.encode(Message("execute", header={"code": "x"}))
    frames[1] = frames[1].replace(b'"x"', b'"y"')  # tampered header
    with pytest.raises(ProtocolError, match="bad signature"):
        signer.decode(frames)


def test_unknown_types_and_bad_frames():
    signer = Signer(new_key())
    with pytest.raises(ProtocolError, match="unknown message type"):
        signer.encode(Message("rm-rf"))
    with pytest.raises(ProtocolError, match="expected 3 frames"):
        signer.decode([b"a", b"b"])
    with pytest.raises(ValueError):
        Signer(b"")


def test_an_oversized_payload_is_refused_with_its_size_and_the_limit():
    signer = Signer(new_key())
    value = bytes(600 * 2**20)
    with pytest.raises(ProtocolError, match=r"600 MiB, over the 256 MiB limit") as refused:
        signer.encode(Message("reply", header={"rank": 0}, payload={"x": value}))
    assert isinstance(refused.value, MessageTooLarge)
    assert refused.value.size_bytes > 600 * 2**20 and refused.value.limit_bytes == MAX_MESSAGE_BYTES
    with pytest.raises(MessageTooLarge):  # text in the header counts too
        signer.encode(Message("stream", header={"text": "x" * MAX_MESSAGE_BYTES}))
    frames = signer.encode(Message("reply", payload=bytes(MAX_MESSAGE_BYTES - 2**20)))  # under: fine
    assert len(signer.decode(frames).payload) == MAX_MESSAGE_BYTES - 2**20


def test_connection_file_is_private(tmp_path):
    info = ConnectionInfo(address="tcp://127.0.0.1:5555", key=new_key(), world_size=2, controller_pid=os.getpid(),
                          controller_started=psutil.Process().create_time())
    path = info.write(tmp_path / "pool.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    read = ConnectionInfo.read(path)
    assert read == info
    assert read.controller_started == info.controller_started
    assert read.path == str(path)  # ranks remove the file when the controller is gone


def test_a_connection_file_without_start_time_still_reads(tmp_path):
    path = tmp_path / "pool.json"
    path.write_text(json.dumps({"address": "tcp://127.0.0.1:5555", "key": "k", "world_size": 2,
                                "controller_pid": 1, "controller_host": "h"}))
    info = ConnectionInfo.read(path)
    assert info.controller_started is None and info.controller_pid == 1


def test_missing_connection_file_says_where_it_comes_from(tmp_path):
    with pytest.raises(FileNotFoundError, match="%mnb start"):
        ConnectionInfo.read(tmp_path / "nope.json")
