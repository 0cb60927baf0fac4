"""A rank's ``input()``, ``getpass``, ``breakpoint()`` and ``%mnb debug``, answered through Jupyter's stdin channel.

One real Jupyter kernel and one 2-rank CPU pool for the module.  The client answers the
kernel's ``input_request`` messages from a script of answers, as JupyterLab's input box does
(``tests/kernel_client.py``); a cell sent without answers runs with ``allow_stdin=False``, as
under nbclient.  pdb differs between Python versions: both CI legs run this file.
"""

from __future__ import annotations

import pytest

from tests.conftest import alive_pids
from tests.kernel_client import Kernel, Late

pytestmark = pytest.mark.slow

R0, R1 = "[r0 tp0 pp0 dp0]", "[r1 tp1 pp0 dp0]"  # the labels under tp2, the layout of every cell here


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    k.ok("%load_ext mnb\nimport mnb")
    k.ok("%mnb start -n 2 --device cpu")
    pids = k.value("mnb.pool().descendants()")
    try:
        yield k
    finally:
        try:
            pids = k.value("mnb.pool().descendants() if mnb.pool().running else []")
        except Exception:  # a failed test may have left the kernel unusable; the start's pids still count
            pass
        k.shutdown()
        assert alive_pids(pids) == [] or pytest.fail(f"left behind: {alive_pids(pids)}")


def traceback_text(result) -> str:
    return "\n".join(result.error["traceback"]) if result.error else ""


def test_input_getpass_and_stdin_on_one_rank_return_what_was_typed(kernel):
    result = kernel.execute(
        "%%megatron --tp 2\n"
        "import getpass, sys\n"
        "if rank == 1:\n"
        "    name = input('name? ')\n"
        "    secret = getpass.getpass()\n"
        "    line = sys.stdin.readline()\n"
        "    print('got', repr(name), len(secret), repr(line))\n"
        "print('done', rank)",
        answers=["alice", "s3cret", "third line"])
    assert not result.errors, traceback_text(result)
    assert result.prompts == [(f"{R1} name? ", False), (f"{R1} Password: ", True), (f"{R1} ", False)]
    assert f"{R1} got 'alice' 6 'third line\\n'" in result.text, result.text
    assert "done 0" in result.text and "done 1" in result.text


def test_breakpoint_on_rank_1_only_with_debug_ranks_p_n_c(kernel):
    result = kernel.execute(
        "%%megatron --tp 2 --debug-ranks 1\n"
        "x = 10 + rank\n"
        "breakpoint()\n"
        "y = x + 1\n"
        "print('after', rank, y)",
        answers=["p (x, ps.get_tensor_model_parallel_rank())", "n", "p y", "c"])
    assert not result.errors, traceback_text(result)
    assert result.prompts == [(f"{R1} (Pdb) ", False)] * 4  # rank 0 skipped its breakpoint
    assert f"{R1} (11, 1)" in result.text and f"{R1} 12" in result.text, result.text
    assert f"{R1} -> y = x + 1" in result.text  # where it stopped, the cell's own lines; `n` onto the last one
    assert f"{R1} -> print('after', rank, y)" in result.text
    assert f"{R0} after 0 11" in result.text and f"{R1} after 1 12" in result.text


def test_two_ranks_at_one_breakpoint_are_served_in_rank_order_and_quit_ends_the_cell(kernel):
    result = kernel.execute(
        "%%megatron --tp 2\n"
        "dist.barrier()  # both ranks reach the breakpoint together\n"
        "x = 100 + rank\n"
        "breakpoint()\n"
        "print('after', rank)",
        answers=["p x", "c", "p x", "q"])
    assert [prompt for prompt, _ in result.prompts] == [f"{R0} (Pdb) "] * 2 + [f"{R1} (Pdb) "] * 2
    assert f"{R0} 100" in result.text and f"{R1} 101" in result.text, result.text
    assert f"mnb: {R0} waits for input; rank(s) [1] keep running" in result.text
    assert result.error["ename"] == "CompositeRankError", result.error
    assert "1 of 2 ranks raised an exception" in result.error["evalue"] and "BdbQuit" in result.error["evalue"]
    assert 'File "<cell-' in traceback_text(result) and "bdb.py" not in traceback_text(result)  # where it quit
    assert "after 0" in result.text and "after 1" not in result.text
    # Kernel -> Interrupt while the input box waits ends the cell like any interrupt
    stopped = kernel.execute("%%megatron --ranks 1\ninput('never answered: ')", answers=[None])
    assert stopped.error["ename"] == "KeyboardInterrupt", traceback_text(stopped)
    assert stopped.prompts == [(f"{R1} never answered: ", False)]
    assert "usable 0" in kernel.ok("%%megatron\nprint('usable', rank)")  # the pool is usable



def test_time_spent_typing_does_not_count_against_the_timeout(kernel):
    """The wait is the user's: a 2-s cell timeout must not fire while rank 1's input box waits 4 s."""
    result = kernel.execute("%%megatron --tp 2 --timeout 2\nif rank == 1:\n    answer = input('ready? ')\n"
                            "    print('got', answer)\nprint('done', rank)", answers=[Late("yes", 4.0)])
    assert not result.errors, traceback_text(result)
    assert f"{R1} got yes" in result.text and "done 0" in result.text and "done 1" in result.text

def test_input_without_stdin_fails_at_once_on_that_rank(kernel):
    result = kernel.execute("%%megatron --tp 2\nif rank == 1:\n    input('name? ')\nprint('fine', rank)", timeout=120)
    assert result.prompts == []
    assert result.error["ename"] == "CompositeRankError"
    text = traceback_text(result)
    assert R1 in text and "NoStdinError: input() on rank 1 asked the notebook for a line" in text
    assert "StdinNotImplementedError" in text and "JupyterLab" in text, text
    assert "fine 0" in result.text and "fine 1" not in result.text


def test_mnb_debug_post_mortem_on_the_root_cause_then_gone_after_a_restart(kernel):
    failed = kernel.execute(
        "%%megatron --tp 2\n"
        "def f(a):\n"
        "    secret = a * 2 + rank\n"
        "    raise ValueError('bad on rank 1')\n"
        "if rank == 1:\n"
        "    f(20)")
    assert failed.error["ename"] == "CompositeRankError"
    result = kernel.execute("%mnb debug", answers=["p (a, secret)", "q"])
    assert not result.errors, traceback_text(result)
    assert result.prompts == [(f"{R1} (Pdb) ", False)] * 2
    assert f"{R1} post-mortem of ValueError: bad on rank 1" in result.text
    assert "-> raise ValueError('bad on rank 1')" in result.text and f"{R1} (20, 41)" in result.text
    kept = kernel.execute("%mnb debug 1", answers=["p secret", "c"])  # kept until the rank's next cell
    assert "41" in kept.text and not kept.errors
    none = kernel.execute("%mnb debug 0", answers=[])  # IPython shows a UsageError as text
    assert "UsageError: rank 0 keeps no failed traceback" in none.text, none.text
    died = kernel.execute("%%megatron\nimport os\nif rank == 1:\n    os._exit(3)")
    assert died.error["ename"] == "RankDiedError", traceback_text(died)
    gone = kernel.execute("%mnb debug", answers=[])
    assert ("UsageError: the frames of rank 1's ValueError: bad on rank 1 are gone: its process was replaced "
            "since (rank(s) [1] died)") in gone.text, gone.text
    assert "back 1" in kernel.ok("%%megatron\nprint('back', rank)")
    assert "UsageError: no failed cell to debug" in kernel.execute("%mnb debug", answers=[]).text


def test_mnb_debug_after_a_failed_script_as_after_a_failed_cell(kernel, tmp_path):
    """api.md: a script's errors are a cell's; %mnb debug opened nothing after a failed %mnb run (the rank dropped
    the frames, and the pool's layout request after the script forgot them)."""
    script = tmp_path / "fails.py"
    script.write_text("import os\nrank = int(os.environ['RANK'])\n\ndef g(x):\n    local = x + 1\n"
                      "    raise RuntimeError('script failed')\n\ng(rank + 6)\n")
    failed = kernel.execute(f"%mnb run {script}")
    assert failed.error["ename"] == "CompositeRankError", traceback_text(failed)
    result = kernel.execute("%mnb debug 1", answers=["p local", "q"])
    assert not result.errors, traceback_text(result)
    label = result.text.split("]", 1)[0] + "]"  # the pool's layout here (dp2): [r1 tp0 pp0 dp1]
    assert label.startswith("[r1 ") and result.prompts == [(f"{label} (Pdb) ", False)] * 2, result.prompts
    assert f"{label} post-mortem of RuntimeError: script failed" in result.text and f"{label} 8" in result.text
    assert "back 1" in kernel.ok("%%megatron\nprint('back', rank)")
