"""A crashed rank's fault-handler dump as the death report quotes it (pure function, no ranks).

The dump is the one Python 3.11's faulthandler wrote on a CPU rank killed by SIGABRT in a gloo
thread during Megatron-FSDP training (2026-12-02): no thread is marked current (the signal came on
a thread Python never ran), so the report says so and shows the cell's thread.  A crash on the
cell's own thread (``ctypes.string_at(0)``) is tested on a real pool in test_pool.py.
"""

from __future__ import annotations

from mnb.controller.reports import FAULT_FRAMES, fault_lines

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
