"""Hangs named down to the collective: real gloo ranks, one 2-rank pool for the module.

A rank that skips one all-reduce of the tp group, a pp rank that skips a send, and a mismatched
collective: the timeout report and ``%mnb stacks`` name the group, the operation and both ranks'
call counts, counted from the start of the cell (the pool's earlier cells made calls on the same
groups).  Where a Python rank can release the stuck one (the skipped call, made in the cell's
``finally`` once the timeout interrupts it), the pool needs no restart; the mismatch does.
"""

from __future__ import annotations

import threading
import time

import pytest

from mnb.config import ParallelConfig
from mnb.errors import CellTimeoutError

pytestmark = pytest.mark.slow

TP2, PP2 = ParallelConfig(tp=2), ParallelConfig(pp=2)
TIMEOUT_S = 10.0
"""The cells reach their hang within milliseconds; the timeout is what a loaded 2-core machine needs to get
there too, so the report finds every rank at the call it hangs in (each test pays it once)."""

COUNTS = "from mnb.megatron import collectives\ncollectives.counts({group})"

SKIP_ALL_REDUCE = """
import os, time
g = ps.get_tensor_model_parallel_group()
x = torch.ones(4)
for i in range(5):
    if rank == 1 and i == 2:
        continue                      # rank 1 skips one all-reduce
    dist.all_reduce(x, group=g)
try:
    while rank == 1 and not os.path.exists({release!r}):
        time.sleep(0.01)
finally:
    if rank == 1:
        dist.all_reduce(x, group=g)   # the skipped one: rank 0 is released
"""

SKIP_SEND = """
import time
g = ps.get_pipeline_model_parallel_group()
x = torch.zeros(2, 3)
try:
    for i in range(3):
        if rank == 0 and i != 1:      # rank 0 skips its second send
            dist.send(x, dst=1, group=g)
        elif rank == 1:
            dist.recv(x, src=0, group=g)
    while rank == 0:
        time.sleep(0.01)
finally:
    if rank == 0:
        dist.send(x, dst=1, group=g)  # the skipped one: rank 1 is released
"""

MISMATCH = """
g = ps.get_tensor_model_parallel_group()
if rank == 0:
    dist.all_reduce(torch.ones(4), group=g)
else:
    dist.all_gather_into_tensor(torch.empty(4), torch.ones(2), group=g)
"""


def tp_calls(pool) -> int:
    """The tp group's calls so far (a process's lifetime): never 0 here, so numbers from the cell's start differ."""
    pool.run("dist.all_reduce(torch.ones(1), group=ps.get_tensor_model_parallel_group())", layout=TP2, quiet=True)
    counts = pool.run(COUNTS.format(group="ps.get_tensor_model_parallel_group()"), layout=TP2, quiet=True)
    assert counts[0]["calls"] == counts[1]["calls"] > 0, counts
    return counts[0]["calls"]


def test_skipped_all_reduce_is_named_in_stacks_and_in_the_timeout_report(cpu_pool, shell, capsys, tmp_path):
    base = tp_calls(cpu_pool)
    release = tmp_path / "release"
    outcome: list = []
    hang = threading.Thread(target=lambda: outcome.append(
        cpu_pool.run(SKIP_ALL_REDUCE.format(release=str(release)), layout=TP2, quiet=True, timeout=120)))
    hang.start()
    expected = ("rank 1 is at all_reduce #4 of tp group [0,1]; rank 0 is at #5 — "
                "rank 1 skipped one (or rank 0 ran one more)")  # the cell's 4th and 5th, not the process's
    deadline = time.monotonic() + 60
    report = ""
    # until rank 0 waits in the cell's #5 and rank 1, past its #4 (counted when it enters the call, so a report
    # can still find it inside), waits in its loop
    while not (expected in report and "time.sleep(0.01)" in report) and time.monotonic() < deadline:
        report = cpu_pool.stacks_report()
    capsys.readouterr()
    shell.run_line_magic("mnb", "stacks")
    shown = capsys.readouterr().out
    read_out = cpu_pool.collectives()  # what the report is made of, as data
    release.touch()
    hang.join(120)
    assert outcome, "the cell did not finish once rank 1 made its skipped all-reduce"
    assert expected in shown, shown
    assert "in all_reduce #5 of tp group [0,1], tensor [4] float32" in shown, shown
    assert "--- rank 1 (r1 tp1 pp0 dp0) ---" in shown and "time.sleep(0.01)" in shown, shown
    tp = {rank: next(g for g in read_out[rank]["groups"] if g["name"] == "tp") for rank in (0, 1)}
    assert {read_out[rank]["source"] for rank in (0, 1)} == {"mnb"}  # gloo ranks: mnb's own count
    assert [(call["op"], call["seq"]) for call in tp[0]["pending"]] == [("all_reduce", 5)], tp[0]
    assert tp[1]["pending"] == [] and tp[1]["calls"] == 4 and tp[0]["ranks"] == [0, 1], tp[1]

    base += 5  # rank 1 made its skipped call: both at base + 5 in the process's count
    with pytest.raises(CellTimeoutError) as timed_out:
        cpu_pool.run(SKIP_ALL_REDUCE.format(release=str(tmp_path / "never")), layout=TP2, timeout=TIMEOUT_S)
    text = str(timed_out.value)
    assert ("rank 1 is at all_reduce #4 of tp group [0,1]; rank 0 is at #5 — "
            "rank 1 skipped one (or rank 0 ran one more)") in text, text
    assert "[r0 tp0 pp0 dp0] in all_reduce #5 of tp group [0,1], tensor [4] float32" in text, text
    assert tp_calls(cpu_pool) == base + 5 + 1  # the same ranks go on, counts agreeing (+1: tp_calls' own)


def test_skipped_send_names_the_recv_that_waits_and_the_peer_s_count(cpu_pool):
    counts = cpu_pool.run(COUNTS.format(group="ps.get_pipeline_model_parallel_group()"), layout=PP2, quiet=True)
    assert counts[0]["sent"].get(1, 0) == counts[1]["received"].get(0, 0), counts  # the process's: the cell counts anew
    with pytest.raises(CellTimeoutError) as timed_out:
        cpu_pool.run(SKIP_SEND, layout=PP2, timeout=TIMEOUT_S)
    text = str(timed_out.value)
    assert ("rank 1 is in recv #3 from rank 0 of pp group [0,1]; rank 0 has sent 2 — "
            "rank 0 skipped a send (or rank 1 receives one more)") in text, text
    assert "[r1 tp0 pp1 dp0] in recv #3 from rank 0 of pp group [0,1], tensor [2, 3] float32" in text


def test_mismatched_collectives_are_named_with_their_common_number(cpu_pool):
    tp_calls(cpu_pool)
    with pytest.raises(CellTimeoutError) as timed_out:
        cpu_pool.run(MISMATCH, layout=TP2, timeout=TIMEOUT_S)
    text = str(timed_out.value)
    assert "rank 0 is in all_reduce, rank 1 in all_gather_into_tensor of tp group [0,1] (#1 on both)" in text, text
    assert "[r1 tp1 pp0 dp0] in all_gather_into_tensor #1 of tp group [0,1], tensor [4] [2] float32" in text
    assert "restarting all 2 ranks" in text  # both stuck in C: the pool replaces them
    assert cpu_pool.run("rank") == {0: 0, 1: 1}
