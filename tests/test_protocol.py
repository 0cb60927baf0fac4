import os
import stat

import pytest

from mnb.protocol import ConnectionInfo, Message, ProtocolError, Signer, new_key


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


def test_connection_file_is_private(tmp_path):
    info = ConnectionInfo(address="tcp://127.0.0.1:5555", key=new_key(), world_size=2, controller_pid=os.getpid())
    path = info.write(tmp_path / "pool.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ConnectionInfo.read(path) == info


def test_missing_connection_file_says_where_it_comes_from(tmp_path):
    with pytest.raises(FileNotFoundError, match="%mnb start"):
        ConnectionInfo.read(tmp_path / "nope.json")
