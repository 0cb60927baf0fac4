"""The diagnosis lines for cases the gloo pool tests do not reach (pure functions, no ranks).

A send whose peer never receives (gloo's send waits for the receiver, so on a real pool this is
the recv test's mirror image), three ranks of which two are behind, a rank that did not answer,
and the Flight Recorder read-out on entries as torch 2.11 on an H200 wrote them
(``bench/gpu_flight_recorder.py``, 2026-12-02).
"""

from __future__ import annotations

import pytest

from mnb.controller import hangs


def group(key="3", name="pp", ranks=(0, 1), calls=0, last="", sent=None, received=None, pending=()):
    return {"key": key, "name": name, "ranks": list(ranks), "calls": calls, "last": last,
            "sent": sent or {}, "received": received or {}, "pending": list(pending)}


def test_a_send_without_a_matching_recv():
    send = {"op": "send", "seq": 3, "peer": 1, "shapes": [[2, 3]], "dtype": "float32", "for_s": 2.0}
    snapshots = {0: {"groups": [group(sent={"1": 3}, pending=[send])]},
                 1: {"groups": [group(received={"0": 2})]}}
    assert hangs.waiting_in(snapshots[0]) == ["send #3 to rank 1 of pp group [0,1], tensor [2, 3] float32, for 2.0 s"]
    assert hangs.diagnose(snapshots) == [
        "rank 0 is in send #3 to rank 1 of pp group [0,1]; rank 1 has received 2 — a send without a matching recv "
        "(rank 1 skipped a recv, or rank 0 sends one more)"]


def test_two_ranks_behind_one_and_a_rank_that_did_not_answer():
    call = {"op": "all_reduce", "seq": 9, "peer": None, "shapes": [[4]], "dtype": "bfloat16", "for_s": 1.0}
    tp = dict(key="5", name="tp", ranks=(0, 1, 2, 3))
    snapshots = {0: {"groups": [group(**tp, calls=9, last="all_reduce", pending=[call])]},
                 1: {"groups": [group(**tp, calls=7, last="all_reduce")]},
                 2: {"groups": [group(**tp, calls=7, last="all_reduce")]},
                 3: None}  # no answer: left out, not counted as behind
    assert hangs.diagnose(snapshots) == [
        "ranks 1,2 are at all_reduce #7 of tp group [0,1,2,3]; rank 0 is at #9 — ranks 1,2 skipped 2 "
        "(or rank 0 ran 2 more)"]


def test_flight_recorder_entries_of_torch_2_11():
    from_trace = pytest.importorskip("mnb.megatron.collectives").from_trace
    entry = {"process_group": ("0", "default_pg"), "collective_seq_id": 0, "p2p_seq_id": 0, "is_p2p": False,
             "retired": False}
    trace = {"pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0]"},
                           "1": {"name": "1", "desc": "undefined", "ranks": "[0]"}},
             "entries": [{**entry, "profiling_name": "nccl:all_reduce", "collective_seq_id": 3, "input_sizes": [[4]],
                          "input_dtypes": ["Float"], "state": "completed"},
                         {**entry, "process_group": ("1", "undefined"), "profiling_name": "nccl:_all_gather_base",
                          "collective_seq_id": 1, "input_sizes": [[2, 3]], "input_dtypes": ["BFloat16"],
                          "state": "completed"},
                         {**entry, "profiling_name": "nccl:all_reduce", "collective_seq_id": 4,
                          "input_sizes": [[8, 16]], "input_dtypes": ["Half"], "state": "scheduled"}]}
    snap = from_trace(trace, {"0": "world", "1": "tp"})
    assert [(hangs.group_text(g), g["calls"], g["last"]) for g in snap["groups"]] == [
        ("world group [0]", 4, "all_reduce"), ("tp group [0]", 1, "all_gather_into_tensor")]
    assert hangs.waiting_in(snap) == ["all_reduce #4 of world group [0], tensor [8, 16] float16, scheduled"]


def test_ranks_that_raised_are_named_as_raised_not_as_having_skipped_a_call():
    call = {"op": "all_reduce", "seq": 4, "peer": None, "shapes": [[4]], "dtype": "float32", "for_s": 3.0}
    world = dict(key="0", name="world", ranks=(0, 1, 2))
    snapshots = {0: {"groups": [group(**world, calls=4, last="all_reduce", pending=[call])]},
                 1: {"groups": [group(**world, calls=3, last="all_reduce")]},
                 2: {"groups": [group(**world, calls=3, last="all_reduce")]}}
    assert hangs.diagnose(snapshots, raised={1: "ValueError", 2: "KeyError"}) == [
        "rank 0 waits in all_reduce #4 of world group [0,1,2]; ranks 1,2 raised KeyError, ValueError "
        "after all_reduce #3"]
    # one of the ranks behind raised, the other finished without the call: that one skipped it
    assert hangs.diagnose(snapshots, raised={1: "ValueError"}) == [
        "ranks 1,2 are at all_reduce #3 of world group [0,1,2]; rank 0 is at #4 — ranks 1,2 skipped one "
        "(or rank 0 ran one more)"]
    # a rank that raised before its first call on the group
    first = dict(call, seq=1)
    snapshots = {0: {"groups": [group(key="0", name="world", calls=1, last="all_reduce", pending=[first])]},
                 1: {"groups": []}}
    assert hangs.diagnose(snapshots, raised={1: "RuntimeError"}) == [
        "rank 0 waits in all_reduce #1 of world group [0,1]; rank 1 raised RuntimeError before its first call on it"]


def test_a_peer_that_raised_is_named_in_point_to_point_lines():
    recv = {"op": "recv", "seq": 3, "peer": 0, "shapes": [[2]], "dtype": "float32", "for_s": 1.0}
    snapshots = {0: {"groups": [group(sent={"1": 2})]}, 1: {"groups": [group(received={"0": 3}, pending=[recv])]}}
    assert hangs.diagnose(snapshots, raised={0: "ValueError"}) == [
        "rank 1 is in recv #3 from rank 0 of pp group [0,1]; rank 0 raised ValueError after sending 2"]
    send = {"op": "send", "seq": 3, "peer": 1, "shapes": [[2]], "dtype": "float32", "for_s": 1.0}
    snapshots = {0: {"groups": [group(sent={"1": 3}, pending=[send])]}, 1: {"groups": [group(received={"0": 2})]}}
    assert hangs.diagnose(snapshots, raised={1: "ValueError"}) == [
        "rank 0 is in send #3 to rank 1 of pp group [0,1]; rank 1 raised ValueError after receiving 2"]


def test_ranks_only_just_in_their_calls_are_running_not_hung():
    """A cell past its timeout in healthy training: each rank answers a fraction of a second into some call, at
    counts that differ.  Nothing is read into that (it said 'rank 0 skipped 6'); the same counts after a second
    of waiting are a hang."""
    def snapshots(waited):
        call = lambda seq: {"op": "all_reduce", "seq": seq, "peer": None, "for_s": waited}  # noqa: E731
        tp = dict(key="5", name="tp", ranks=(0, 1))
        return {0: {"groups": [group(**tp, calls=583, last="all_reduce", pending=[call(583)])]},
                1: {"groups": [group(**tp, calls=589, last="all_reduce", pending=[call(589)])]}}

    assert hangs.diagnose(snapshots(0.0)) == []
    assert hangs.diagnose(snapshots(hangs.SETTLED_S)) == [
        "rank 0 is at all_reduce #583 of tp group [0,1]; rank 1 is at #589 — rank 0 skipped 6 (or rank 1 ran 6 more)"]
    recv = {"op": "recv", "seq": 5, "peer": 0, "for_s": 0.2}
    moving = {0: {"groups": [group(sent={"1": 4})]}, 1: {"groups": [group(pending=[recv])]}}
    assert hangs.diagnose(moving) == []
