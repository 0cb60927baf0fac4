"""The events channel between Megatron-side code and the worker."""

import pytest

from mnb.megatron import events


@pytest.fixture(autouse=True)
def clean():
    events.set_sink(None)
    events.take_records()
    yield
    events.set_sink(None)
    events.take_records()


def test_emit_without_sink_is_a_noop():
    events.set_sink(None)
    events.take_records()
    assert events.emit("progress", {"step": 1}) is None
    assert events.take_records() == []  # progress events are not stored as records


def test_sink_receives_events_and_records():
    seen = []
    events.set_sink(lambda kind, payload: seen.append((kind, payload)))
    events.emit("progress", {"step": 1})
    events.publish_record({"rank": 0})
    assert seen == [("progress", {"step": 1}), ("run_record", {"rank": 0})]
    assert events.take_records() == [{"rank": 0}]
    assert events.take_records() == []


def test_records_kept_without_sink():
    events.publish_record({"rank": 3})
    assert events.take_records() == [{"rank": 3}]


def test_sink_must_be_callable():
    with pytest.raises(TypeError):
        events.set_sink(42)
