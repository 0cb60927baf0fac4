"""Where a rank stands, as the interrupt and timeout reports say it: ``collector.last_frame`` and
``user_place`` over the texts a rank really sends (no pool): a stack the rank's I/O thread took of a
running cell (``worker.channel.main_thread_stack``) and a failed cell's traceback
(``worker.executor.run_cell``)."""

from __future__ import annotations

import threading
import time

from mnb.controller.collector import last_frame, user_place
from mnb.worker.channel import main_thread_stack
from mnb.worker.executor import run_cell

WAITING_CELL = "started.set()\ndone.wait()\n"


def _stack_of_a_waiting_cell(number: int) -> str:
    """The stack of a cell that waits in ``threading.Event.wait``, taken from another thread as the rank's
    I/O thread takes it (asked again until the cell is inside the wait: it may still be between lines)."""
    started, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=run_cell, args=(WAITING_CELL, {"started": started, "done": done}),
                              kwargs={"number": number})
    worker.start()
    try:
        assert started.wait(60), "the cell never started"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stack = main_thread_stack(worker.ident)
            if "in wait" in stack:
                return stack
            time.sleep(0.01)
        raise AssertionError(f"the cell never reached done.wait():\n{stack}")
    finally:
        done.set()
        worker.join(60)


def test_a_cell_waiting_in_a_library_call_names_its_line_then_the_call():
    stack = _stack_of_a_waiting_cell(7)
    assert stack.lstrip().startswith('File "<cell-7>", line 2')  # mnb's exec loop cut off
    where = last_frame(stack)
    assert where.startswith("cell line 2 `done.wait()` -> threading.py:"), where
    assert where.endswith(" in wait"), where
    assert user_place(stack) == "cell line 2 `done.wait()`"


def test_a_failed_cells_traceback_ends_on_the_cells_own_line():
    outcome = run_cell("a = 1\nb = a / 0\n", {}, number=3)
    assert not outcome.ok and outcome.ename == "ZeroDivisionError"
    assert last_frame(outcome.traceback) == "cell line 2 `b = a / 0`"


def test_without_a_user_frame_the_innermost_frame_is_said_and_no_stack_says_nothing():
    """mnb starting or ending a cell: no frame of a cell or the user's files."""
    stack = main_thread_stack(threading.main_thread().ident)  # this test's own frames are pytest's and the test's
    assert user_place('  File "/usr/lib/python3.11/threading.py", line 327, in wait\n    waiter.acquire()\n') == ""
    assert last_frame('  File "/usr/lib/python3.11/threading.py", line 327, in wait\n    waiter.acquire()\n') == (
        "threading.py:327 in wait: waiter.acquire()")
    assert last_frame("") == "" and last_frame("(main thread not found)") == ""
    assert "test_where.py" in last_frame(stack)  # a file outside mnb and the libraries is the user's
