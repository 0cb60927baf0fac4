"""What real use does to the pool, through a real Jupyter kernel (CPU ranks, gloo).

One rank failing while the others wait in a collective, Kernel -> Interrupt at
random moments of training, a SIGKILLed kernel, processes the ranks started,
a print loop interrupted: each case checks what the notebook shows and that
the next cell works with no %mnb restart.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest

from tests.conftest import alive_pids
from tests.kernel_client import Kernel

pytestmark = pytest.mark.slow

GRACE_S = 3.0  # the default of %mnb start --grace


@pytest.fixture(scope="module")
def module_kernel():
    """One Jupyter kernel with a 2-rank pool for the module; shut down at its end, leaving no process."""
    k = Kernel()
    k.ok("%load_ext mnb\nimport mnb, sys")
    k.ok("%mnb start -n 2 --device cpu")
    try:
        yield k
    finally:
        try:
            pids = k.value("mnb.pool().descendants() if mnb.pool().running else []")
        except Exception:  # a test left the kernel unable to answer: its shutdown still ends the pool
            pids = []
        k.shutdown()
        left = wait_gone(pids, 15)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert left == [], "processes left behind after the kernel shut down"


RESET = (
    "from mnb.config import ParallelConfig as _Layout\n"
    "from mnb.controller import current_pool as _current\n"
    "if _current(required=False) is None or not _current().running:\n"
    "    get_ipython().run_line_magic('mnb', 'start -n 2 --device cpu')\n"
    "mnb.pool().event_handlers.clear()\n"
    "try:\n"
    "    mnb.pool().run('pass', layout=_Layout(), quiet=True, timeout=120)\n"
    "except Exception:\n"
    "    get_ipython().run_line_magic('mnb', 'restart')\n"
)
"""Before each test: a running pool in the default layout (started again after a test stopped it,
restarted after one left it broken), no event handlers a test added."""


@pytest.fixture
def kernel(module_kernel):
    """The module's kernel, its pool reset (``RESET``): the tests run in sequence on one pool, as a notebook's cells do."""
    module_kernel.ok(RESET)
    return module_kernel


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while alive_pids(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive_pids(pids)


def rendered(result) -> str:
    return "\n".join(result.error["traceback"]) if result.error else ""


@pytest.mark.parametrize("failure", ["raise ValueError('root cause')", "raise SystemExit(2)"])
def test_root_cause_is_shown_at_once_and_the_next_cell_runs(kernel, failure):
    restarts = kernel.value("mnb.pool().restarts")
    cell = ("%%megatron\nimport time\nif rank == 0:\n    print('raising at', repr(time.time()), flush=True)\n"
            f"    {failure}\ndist.barrier()\n")
    result = kernel.execute(cell)
    raised_at = float(re.search(r"raising at (\d+\.\d+)", result.text)[1])
    shown_at = result.first_time("failed first")
    assert shown_at is not None, result.text
    assert shown_at - raised_at <= 1.0  # the root cause, at once, with no --timeout
    assert result.ended - raised_at <= GRACE_S + 2.0
    text = rendered(result)
    assert result.error["ename"] == "CompositeRankError"
    cause = "ValueError: root cause" if "ValueError" in failure else "SystemExit: 2"
    assert cause in text and "(first failure)" in text
    assert text.index(cause) < text.index("was still running at cell line 5 `dist.barrier()`")
    assert re.search(r"`dist.barrier\(\)` -> \S+ in \w+; in barrier #\d+ of world group \[0,1\]", text), text
    assert "restarting all 2 ranks" in text and "names defined in earlier cells are gone" in text
    after = kernel.ok("%%megatron\nprint('after', rank)")  # no %mnb restart typed
    assert "after 0" in after and "after 1" in after
    assert kernel.value("mnb.pool().restarts") == restarts + 1


def test_a_rank_that_exits_is_named_with_its_code_and_replaced(kernel):
    result = kernel.execute("%%megatron\nimport os\nif rank == 1:\n    os._exit(0)\ndist.barrier()")
    assert result.error["ename"] == "RankDiedError"
    text = rendered(result)
    assert "rank 1 (r1 tp0 pp0 dp1) died: exit code 0" in text and "restarting all 2 ranks" in text
    assert len(result.error["traceback"]) <= 6  # the message, not mnb's own traceback
    assert "after 1" in kernel.ok("%%megatron\nprint('after', rank)")


FINGERPRINT = (
    "%%megatron\n"
    "import hashlib\n"
    "_h = hashlib.sha256()\n"
    "for _c in model.chunks:\n"
    "    for _n, _p in sorted(_c.named_parameters()):\n"
    "        if not getattr(_p, 'tensor_model_parallel', False):\n"
    "            _h.update(_n.encode()); _h.update(_p.detach().float().numpy().tobytes())\n"
    "print('state', ps.get_pipeline_model_parallel_rank(), model.steps_done, model.consumed_samples, _h.hexdigest())\n"
)


def rank_states(text: str) -> list[tuple[str, str, str, str]]:
    """The FINGERPRINT line of each rank; identical lines come folded as ``[r0-1] state ...``."""
    found = []
    for label, *state in re.findall(r"\[(r[0-9,-]+)[^\]]*\] state (\d+) (\d+) (\d+) ([0-9a-f]{64})", text):
        folded = re.fullmatch(r"r(\d+)-(\d+)", label)
        found += [tuple(state)] * ((int(folded[2]) - int(folded[1]) + 1) if folded else 1)
    return found


INTERRUPTS = int(os.environ.get("MNB_TEST_INTERRUPTS", "10"))
"""Random interrupts for ``--pp 2``, the hard case (CI: 10; the issue-10 checks ran 20, and 110 more by
hand); the other layouts get 3 each (``MNB_TEST_INTERRUPTS`` scales them alike)."""


@pytest.mark.parametrize("flags, interrupts", [("--tp 2", max(1, INTERRUPTS * 3 // 10)), ("--pp 2", INTERRUPTS),
                                               ("--tp 1 --pp 1", max(1, INTERRUPTS * 3 // 10))])
def test_random_interrupts_during_training_never_split_the_ranks(kernel, flags, interrupts):
    kernel.ok(f"%%megatron {flags}\nmodel = mnb.gpt('tiny')")
    restarts = kernel.value("mnb.pool().restarts")
    train = ("%%megatron\nif 'model' not in globals():\n    model = mnb.gpt('tiny')\n"
             "mnb.train(model, steps=2000, micro_batch_size=2, global_batch_size=8, lr=1e-3)")
    rng = random.Random(10 + interrupts)
    for attempt in range(interrupts):
        msg_id = kernel.send(train)
        time.sleep(rng.uniform(0.05, 2.5))
        kernel.interrupt()
        result = kernel.wait(msg_id)
        assert result.error and result.error["ename"] == "KeyboardInterrupt", (attempt, result.text)
        lines = result.error["traceback"]
        assert len(lines) <= 3 and "mnb/controller" not in "\n".join(lines), lines  # one line, no mnb frames
        states = kernel.ok(FINGERPRINT)  # a usable pool, every time
        found = rank_states(states)
        assert len(found) == 2, states
        steps = {(steps_done, samples) for _, steps_done, samples, _ in found}
        assert len(steps) == 1, f"ranks disagree on the step after interrupt {attempt}: {found}"
        if "--pp 2" not in flags:  # tp/dp replicas hold the same replicated weights
            assert found[0][3] == found[1][3], f"replicas differ after interrupt {attempt}"
    assert "continues" in kernel.ok("%%megatron\nr = mnb.train(model, steps=2, micro_batch_size=2, "
                                    "global_batch_size=8)\nprint('continues', len(r['steps']))")
    assert kernel.value("mnb.pool().restarts") == restarts  # every interrupt landed in mnb.train: no rank was replaced


def test_killed_kernel_mid_training_leaves_no_process_and_no_secret(tmp_path):
    training = tmp_path / "training"  # written at the first training forward: the kill lands mid-run
    kernel = Kernel()
    try:
        kernel.ok("%load_ext mnb\nimport mnb")
        kernel.ok("%mnb start -n 2 --device cpu")
        kernel.ok("%%megatron\nimport subprocess\nchild = subprocess.Popen(['sleep', '300'])\nmodel = mnb.gpt('tiny')")
        pids = kernel.value("mnb.pool().descendants()")
        workdir = kernel.value("str(mnb.pool().workdir())")
        assert len(pids) >= 5  # torchrun, 2 ranks, the ranks' children
        kernel.send("%%megatron\n"  # the first training forward writes the file
                    f"model.chunks[0].register_forward_pre_hook(lambda *_: open({str(training)!r}, 'w').close())\n"
                    "mnb.train(model, steps=100000, micro_batch_size=2, global_batch_size=8)")
        deadline = time.monotonic() + 300.0
        while not training.exists():
            assert time.monotonic() < deadline, "no training step within 300 s"
            time.sleep(0.05)
        os.kill(kernel.pid, signal.SIGKILL)  # not reaped yet: a zombie until the manager polls it
        left = wait_gone(pids, 60.0)  # a few seconds by design; a loaded 2-core machine took more than 5
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert left == [], "pool processes outlived the killed kernel by 60 s"
        assert not os.path.exists(workdir), "the pool's folder (with its secret) was left behind"
    finally:
        kernel.client.stop_channels()
        kernel.manager.cleanup_resources()


def test_interrupted_print_loop_is_not_replayed_into_the_next_cell(kernel):
    """Kernel -> Interrupt reaches every rank through a real kernel (the end-to-end interrupt test; the
    random interrupts below are the property test): a loop only an interrupt ends, one short error
    naming the interrupted ranks, the same ranks after it with their names kept, no output replayed."""
    restarts = kernel.value("mnb.pool().restarts")
    msg_id = kernel.send("%%megatron\ni = 0\nwhile True:\n    print('line', i)\n    i += 1")
    kernel.wait_for_text(msg_id, "line 150")
    kernel.interrupt()
    result = kernel.wait(msg_id)
    assert result.error["ename"] == "KeyboardInterrupt" and len(result.error["traceback"]) <= 3
    text = rendered(result)
    # both ranks named, at one line or (the interrupt lands between two lines of the loop) at two
    both = "interrupted rank(s) [0, 1]" in text or ("interrupted rank(s) [0] at cell line" in text
                                                    and "rank(s) [1] at cell line" in text)
    assert both and "mnb/" not in text, text
    assert result.text.count("line") > 100  # it was printing
    following = kernel.execute("%%megatron\nprint('fresh', rank, i > 0)")
    assert not following.errors
    assert "fresh 0 True" in following.text and "fresh 1 True" in following.text, following.text
    assert "line" not in following.text and "late" not in following.text
    assert kernel.value("mnb.pool().restarts") == restarts  # the same ranks


def test_status_and_stacks_answer_while_a_background_run_holds_the_pool(kernel, tmp_path):
    release = tmp_path / "release"  # the background cell runs until the test has asked
    cell = ("from mnb.megatron import events\nimport os, time\n"
            f"def wait_for_release():\n    while not os.path.exists({str(release)!r}):\n        time.sleep(0.02)\n"
            "events.emit('test-running', {})\nwait_for_release()")
    kernel.ok("import threading\n"
              "running = set()\n"  # ranks whose cell started: events, not a sleep, order the threads
              "mnb.pool().event_handlers.append(\n"
              "    lambda rank, kind, payload: kind == 'test-running' and running.add(rank))\n"
              f"bg = threading.Thread(target=lambda: mnb.pool().run({cell!r}, quiet=True, timeout=120))\n"
              "bg.start()\nimport time\ndeadline = time.monotonic() + 60\n"
              "while len(running) < 2 and time.monotonic() < deadline:\n    time.sleep(0.02)\n"
              "assert len(running) == 2, running")
    status = kernel.ok("%mnb status")
    assert status.count("busy") == 2, status
    stacks = kernel.ok("%mnb stacks")
    assert stacks.count("in wait_for_release") == 2, stacks  # both ranks, where they wait
    release.touch()
    kernel.ok("bg.join()")
    assert kernel.ok("%mnb status").count("idle") == 2


def test_pulling_a_torch_function_keeps_torch_out_of_the_kernel(kernel):
    kernel.ok("%%megatron\nf = torch.nn.functional.relu\nx = torch.ones(2) * rank")
    text = kernel.value("repr(mnb.pool().pull('f')[0])")
    assert "relu" in text
    assert kernel.value("mnb.pool().pull('x')[1].tolist()") == [1.0, 1.0]
    assert kernel.value("'torch' in sys.modules") is False
    pushed = kernel.execute("mnb.pool().push({'g': lambda v: v})")
    assert pushed.error["ename"] == "PushRefused"  # a TypeError: `except TypeError` catches it
    assert "TypeError: " in rendered(pushed) and "'g'" in rendered(pushed)
    assert kernel.ok("%mnb status").count("idle") == 2


def test_stop_ends_everything_the_ranks_started_and_removes_the_folder(kernel, tmp_path):
    """Last in the module: it ends the module kernel's pool (a test after it would start another)."""
    kernel.ok("%%megatron\nimport subprocess, multiprocessing, time\n"
              "child = subprocess.Popen(['sleep', '300'])\n"
              "helper = multiprocessing.get_context('fork').Process(target=time.sleep, args=(300,))\n"
              "helper.start()\n"
              f"model = mnb.gpt('tiny')\nmnb.save({str(tmp_path / 'ck')!r}, model)")
    pids = kernel.value("mnb.pool().descendants()")
    workdir = kernel.value("str(mnb.pool().workdir())")
    assert len(pids) >= 7  # torchrun, 2 ranks, 2 sleeps, 2 helpers (and any checkpoint writers)
    assert "stopped 2 ranks" in kernel.ok("%mnb stop")
    assert alive_pids(pids) == []
    assert not os.path.exists(workdir)
