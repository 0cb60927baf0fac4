"""The death report's pure parts, no ranks: how each rank ended (``death_lines``) and a crashed rank's
fault-handler dump as the report quotes it (``fault_lines``).

``death_lines`` is given :meth:`Launcher.deaths`' account, whose words come from ``describe_exit``
(torchrun's exit code or signal, with the pid) or, for a remote rank, the heartbeat's silence.

The dump is the one Python 3.11's faulthandler wrote on a CPU rank killed by SIGABRT in a gloo
thread during Megatron-FSDP training (2026-12-02): no thread is marked current (the signal came on
a thread Python never ran), so the report says so and shows the cell's thread.  A crash on the
cell's own thread (``ctypes.string_at(0)``) is tested on a real pool in test_pool.py.
"""

from __future__ import annotations

import signal

from mnb.controller.launcher import describe_exit
from mnb.controller.reports import FAULT_FRAMES, death_lines, fault_lines

LABELS = {0: "r0 tp0 pp0 dp0", 1: "r1 tp0 pp0 dp1", 2: "r2 tp0 pp1 dp0", 3: "r3 tp0 pp1 dp1"}

GLOO_ABORT = """Fatal Python error: Aborted

Thread 0x00007f2f667fc6c0 (most recent call first):
  File "/work/main/mnb/worker/capture.py", line 194 in _pump
  File "/usr/lib/python3.11/threading.py", line 982 in run

Thread 0x00007f2faf5f0b80 (most recent call first):
  File "/site-packages/megatron/core/tensor_parallel/cross_entropy.py", line 49 in calculate_predicted_logits
  File "/site-packages/megatron/core/tensor_parallel/cross_entropy.py", line 142 in forward
  File "/work/main/mnb/megatron/train.py", line 314 in train
  File "<cell-7>", line 2 in <module>
  File "/work/main/mnb/worker/executor.py", line 54 in run_cell
  File "/work/main/mnb/worker/main.py", line 395 in _execute

Extension modules: psutil._psutil_linux, torch._C (total: 2)
"""


def test_the_rank_that_failed_comes_first_and_torchruns_sigterm_is_a_tear_down():
    deaths = {0: f"{describe_exit(-signal.SIGTERM)} (pid 40)", 1: f"{describe_exit(-signal.SIGTERM)} (pid 41)",
              2: f"{describe_exit(3)} (pid 42)", 3: f"{describe_exit(-signal.SIGTERM)} (pid 43)"}
    lines, first = death_lines(deaths, LABELS)
    assert first == [2]
    assert lines == ["rank 2 (r2 tp0 pp1 dp0) died: exit code 3 (pid 42)",
                     "rank 0 (r0 tp0 pp0 dp0) died: torn down by torchrun after the failure "
                     "(killed by signal SIGTERM (pid 40))",
                     "rank 1 (r1 tp0 pp0 dp1) died: torn down by torchrun after the failure "
                     "(killed by signal SIGTERM (pid 41))",
                     "rank 3 (r3 tp0 pp1 dp1) died: torn down by torchrun after the failure "
                     "(killed by signal SIGTERM (pid 43))"]


def test_a_crash_by_another_signal_is_the_root_cause_and_several_failures_keep_rank_order():
    deaths = {3: f"{describe_exit(-signal.SIGSEGV)} (pid 43)", 0: f"{describe_exit(-signal.SIGTERM)} (pid 40)",
              1: f"{describe_exit(1)} (pid 41)"}
    lines, first = death_lines(deaths, LABELS)
    assert first == [1, 3]
    assert [line.split(" died: ")[1] for line in lines] == [
        "exit code 1 (pid 41)", "killed by signal SIGSEGV (pid 43)",
        "torn down by torchrun after the failure (killed by signal SIGTERM (pid 40))"]


def test_when_every_rank_got_sigterm_none_is_torn_down_and_all_came_first():
    """A SIGTERM from outside the pool (a user's kill, a scheduler): no rank failed before the others."""
    deaths = {r: f"{describe_exit(-signal.SIGTERM)} (pid {40 + r})" for r in (1, 0)}
    lines, first = death_lines(deaths, LABELS)
    assert first == [0, 1]
    assert lines == ["rank 0 (r0 tp0 pp0 dp0) died: killed by signal SIGTERM (pid 40)",
                     "rank 1 (r1 tp0 pp0 dp1) died: killed by signal SIGTERM (pid 41)"]


def test_a_silent_remote_rank_and_one_without_a_label_are_counted_as_failures():
    """Pool._death_report adds a remote rank's silence; a rank no longer in the table has no line."""
    deaths = {2: "no heartbeat for 35 s (host node2)", 5: f"{describe_exit(-signal.SIGTERM)} (pid 45)",
              0: "exit code 0 (pid 40)"}
    lines, first = death_lines(deaths, LABELS)
    assert first == [0, 2]
    assert lines == ["rank 0 (r0 tp0 pp0 dp0) died: exit code 0 (pid 40)",
                     "rank 2 (r2 tp0 pp1 dp0) died: no heartbeat for 35 s (host node2)"]
    assert death_lines({}, LABELS) == ([], [])


def test_a_crash_on_a_thread_without_python_shows_the_cells_thread_down_to_its_line():
    lines = fault_lines(GLOO_ABORT, "model = mnb.gpt('tiny')\nmnb.train(model, steps=15)\n")
    assert lines[0] == "  Fatal Python error: Aborted"
    assert "the thread that crashed runs no Python" in lines[1]
    assert lines[2] == "  the thread running the cell was at, most recent call first:"
    assert lines[3].endswith("cross_entropy.py, line 49 in calculate_predicted_logits")
    assert lines[-1] == "    <cell-7>, line 2 in <module>: mnb.train(model, steps=15)"  # mnb's own frames below it cut
    assert not any("_pump" in line or "executor.py" in line for line in lines)


def test_long_stacks_are_cut_and_an_empty_file_says_nothing():
    frames = "".join(f'  File "/lib/m{i}.py", line {i} in f{i}\n' for i in range(FAULT_FRAMES + 3))
    lines = fault_lines(f"Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n{frames}")
    assert lines[1] == "  in the thread that crashed, most recent call first:"
    assert len(lines) == 2 + FAULT_FRAMES + 1 and lines[-1] == "    ... 3 more"
    assert fault_lines("") == []
