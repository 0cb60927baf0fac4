"""The pool with real torchrun-launched CPU ranks: no mocks."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import psutil
import pytest
import zmq

import mnb
from mnb.config import ParallelConfig
from mnb.controller import Pool
from mnb.errors import CellTimeoutError, CompositeRankError, PoolError, RankDiedError
from tests.conftest import assert_no_orphans

pytestmark = pytest.mark.slow


def test_ranks_report_identity_and_names_persist(cpu_pool, capsys):
    assert sorted(cpu_pool.ranks) == [0, 1]
    assert {i.backend for i in cpu_pool.ranks.values()} == {"gloo"}
    cpu_pool.run("x = rank * 10\nprint('x is', x)")
    out = capsys.readouterr().out
    assert "[r0 tp0 pp0 dp0] x is 0" in out and "[r1 tp0 pp0 dp1] x is 10" in out
    assert cpu_pool.pull("x") == {0: 0, 1: 10}
    assert cpu_pool.run("x + world_size") == {0: 2, 1: 12}


def test_what_a_forked_child_prints_reaches_the_cell(cpu_pool, capsys):
    """User trial 12-05: a ``multiprocessing`` child (fork on Linux) printed into its copy of the rank's stream,
    whose channel thread the fork did not copy: nothing arrived.  It now prints to the captured fds."""
    cpu_pool.run("import multiprocessing as _mp\n"
                 "_p = _mp.get_context('fork').Process(target=print, args=('forked child of', rank))\n"
                 "_p.start(); _p.join()\n"
                 "_p.exitcode")
    out = capsys.readouterr().out
    assert re.search(r"\[r0 [^\]]*\] forked child of 0", out) and re.search(r"\[r1 [^\]]*\] forked child of 1", out), out


def test_a_failing_str_or_repr_of_the_users_is_shown_as_theirs(cpu_pool, capsys):
    """User trial 12-05: an exception whose ``__str__`` raises, or a last expression whose ``__repr__`` raises,
    failed the cell with mnb's frames (the repr on the display rank alone).  Now the exception is the cell's
    own (as the traceback module shows it) and the repr's failure is shown as IPython shows it, from the
    user's frame, the cell still succeeding."""
    with pytest.raises(CompositeRankError) as info:
        cpu_pool.run("class E(Exception):\n    def __str__(self):\n        raise RuntimeError('str fails')\nraise E()",
                     quiet=True)
    text = str(info.value)
    assert "2 of 2 ranks raised" in text and "E: <exception str() failed" in text and "mnb/worker" not in text, text
    capsys.readouterr()
    cpu_pool.run("class R:\n    def __repr__(self):\n        raise RuntimeError('repr fails')\nR()", show_result=True)
    err = capsys.readouterr()
    shown = err.out + err.err
    assert "RuntimeError: repr fails" in shown and 'File "<cell-' in shown and "mnb/worker" not in shown, shown


def test_push_pull_and_tensors_arrive_as_numpy(cpu_pool):
    cpu_pool.push({"lr": 0.5, "name": "a"}, ranks=[1])
    assert cpu_pool.pull("lr", ranks=[1]) == {1: 0.5}
    with pytest.raises(CompositeRankError, match="not defined on rank 0"):
        cpu_pool.pull("lr", ranks=[0])
    cpu_pool.run("t = torch.arange(4, dtype=torch.bfloat16) + rank")
    pulled = cpu_pool.pull("t")
    assert type(pulled[0]).__module__ == "numpy"
    assert pulled[1].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_layout_change_in_place_and_identical_output_folded(cpu_pool, capsys):
    pids = {r: i.pid for r, i in cpu_pool.ranks.items()}
    cpu_pool.run("print(ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size())",
                 layout=ParallelConfig(tp=2))
    out = capsys.readouterr().out
    assert "[r0-1] 2 1" in out
    assert cpu_pool.layout.tp == 2 and cpu_pool.layout.dp == 1
    assert cpu_pool.run("ps.get_tensor_model_parallel_rank()") == {0: 0, 1: 1}
    cpu_pool.run("print(ps.get_pipeline_model_parallel_world_size())", layout=ParallelConfig(pp=2))
    assert "[r0-1] 2" in capsys.readouterr().out
    assert {r: i.pid for r, i in cpu_pool.ranks.items()} == pids  # same processes
    cpu_pool.run("pass", layout=ParallelConfig())


def test_exception_on_one_rank_raises_one_composite_error(cpu_pool):
    with pytest.raises(CompositeRankError) as info:
        cpu_pool.run("if rank == 1:\n    raise ValueError('bad value on ' + str(rank))")
    error = info.value
    assert error.ranks == [1]
    rendered = "\n".join(error._render_traceback_())
    assert "ValueError: bad value on 1" in rendered
    assert "r1 tp0 pp0 dp1" in rendered
    assert "raise ValueError" in rendered  # the cell's own line is in the traceback
    assert cpu_pool.run("rank") == {0: 0, 1: 1}  # still usable


def test_every_rank_failing_alike_shows_one_traceback_and_stops_nobody(cpu_pool, capsys):
    capsys.readouterr()
    with pytest.raises(CompositeRankError) as info:  # both fail at once: only the cell's error speaks
        cpu_pool.run("raise ValueError('same on every rank')", grace=60)
    err = capsys.readouterr().err
    assert "failed first" not in err and "stopped" not in err
    rendered = "\n".join(info.value._render_traceback_())
    assert "[r0-1]" in rendered and rendered.count("raise ValueError('same on every rank')") == 1
    # rank 1 fails alike but late: the root cause is printed while it runs, the error refers to it
    with pytest.raises(CompositeRankError) as info:
        cpu_pool.run("import time\nif rank == 1:\n    time.sleep(1.5)\nraise ValueError('late')", grace=60)
    err = capsys.readouterr().err
    rendered = "\n".join(info.value._render_traceback_())
    assert "[r0 tp0 pp0 dp0] failed first:" in err and "rank(s) [1] still running" in err
    assert (err + rendered).count("raise ValueError('late')") == 1
    assert "[r0-1]" in rendered and "(the traceback printed above; ValueError: late)" in rendered
    assert info.value.waiting == {} and "interrupted" not in rendered
    assert cpu_pool.run("rank") == {0: 0, 1: 1}


def test_identical_tracebacks_fold_after_a_cell_that_ran_on_some_ranks_only(cpu_pool):
    """The cell's number is the controller's (one per request), not each rank's count of its cells:
    after a cell on rank 0 alone the ranks' tracebacks named <cell-4> and <cell-3> and printed twice."""
    cpu_pool.run("None", ranks=[0], quiet=True)
    with pytest.raises(CompositeRankError) as info:
        cpu_pool.run("raise ValueError('same on every rank')", grace=60, quiet=True)
    groups = info.value.groups()
    assert len(groups) == 1 and [e.rank for e in groups[0][0]] == [0, 1], groups
    assert re.search(r'File "<cell-\d+>", line 1, in <module>', groups[0][1]), groups


def test_invalid_requests_are_refused_before_ranks_run(cpu_pool):
    with pytest.raises(ValueError, match=r"tp\(4\) \* pp\(1\) \* cp\(1\) = 4 does not divide world size 2"):
        cpu_pool.run("x = 1", layout=ParallelConfig(tp=4))
    with pytest.raises(ValueError, match="not in this pool of world size 2"):
        cpu_pool.run("x = 1", ranks=[5])
    with pytest.raises(ValueError, match="needs every rank"):
        cpu_pool.run("x = 1", ranks=[0], layout=ParallelConfig(tp=2))
    # the magics' rules for --timeout and --grace (mnb.fields.check_seconds), the argument named
    for bad, error, words in ((dict(timeout=0), ValueError, "timeout must be a positive number of seconds, got 0"),
                              (dict(timeout=-1), ValueError, "timeout must be a positive number"),
                              (dict(timeout="x"), TypeError, r"timeout must be a positive number of seconds, got 'x'"),
                              (dict(grace=-5), ValueError, "grace must be a number, zero or positive")):
        with pytest.raises(error, match=words):
            cpu_pool.run("x = 1", **bad)
    with pytest.raises(TypeError, match=r"code must be a str of Python source, got bytes .*code\.decode\(\)"):
        cpu_pool.run(b"rank")
    with pytest.raises(TypeError, match="code must be a str of Python source, got NoneType"):
        cpu_pool.run(None)
    with pytest.raises(TypeError, match=r"args is a list of the script's arguments.*shlex\.split"):
        cpu_pool.run_script(__file__, "--lr 3e-4")
    with pytest.raises(ValueError, match="grace must be"):
        cpu_pool.run_script(__file__, grace=-1)
    with pytest.raises(ValueError, match=r"push would rebind mnb's own name\(s\) \['rank'\]"):
        cpu_pool.push({"rank": 0})
    assert cpu_pool.run("rank") == {0: 0, 1: 1}


def test_a_request_over_the_message_limit_is_refused_and_leaves_the_pool_as_it_was(cpu_pool, tmp_path, monkeypatch):
    """A push, a cell or a script's arguments past the limit of one message: refused before any rank is
    marked busy, so the next request runs on the same ranks with every name and the layout kept."""
    from mnb import protocol
    from mnb.errors import MessageTooLarge

    cpu_pool.run("kept = rank")
    pids, restarts, layout = cpu_pool.pids(), cpu_pool.restarts, cpu_pool.layout
    script = tmp_path / "script.py"
    script.write_text("pass\n")
    big = "x" * (2 * 2**20)
    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 2**20)  # the kernel's limit of one message: 1 MiB
    with pytest.raises(MessageTooLarge, match=r"a push message would be 2(\.\d)? MiB.*nothing was sent"):
        cpu_pool.push({"big": big})
    with pytest.raises(MessageTooLarge, match="an execute message .*the cell's code"):
        cpu_pool.run(f"# {big}", layout=ParallelConfig(tp=2))  # a layout change too: it must not be taken
    with pytest.raises(MessageTooLarge, match="an execute message"):
        cpu_pool.run_script(script, [big])
    monkeypatch.undo()
    assert [row["state"] for row in cpu_pool.status()] == ["idle", "idle"]
    assert cpu_pool.layout == layout and cpu_pool.ranks[1].coords == layout.coordinates(1)
    assert cpu_pool.run("kept") == {0: 0, 1: 1}
    assert (cpu_pool.pids(), cpu_pool.restarts) == (pids, restarts)


def test_interruptible_python_loop_times_out_and_pool_stays_usable(cpu_pool):
    with pytest.raises(CellTimeoutError) as info:
        cpu_pool.run("while True:\n    pass", timeout=1)
    message = str(info.value)
    assert "timed out after 1 s" in message and "cell line 1 `while True:`" in message
    assert "All ranks were interrupted" in message
    assert cpu_pool.run("rank") == {0: 0, 1: 1}


def test_forged_messages_are_dropped(cpu_pool):
    info = json.loads((cpu_pool.workdir() / "pool.json").read_text())
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"rank-9")
    sock.connect(info["address"])
    before = cpu_pool._transport.dropped
    sock.send_multipart([b"0" * 64, b'{"type":"reply","id":"x","rank":0}', b""])
    deadline = time.monotonic() + 5
    while cpu_pool._transport.dropped == before and time.monotonic() < deadline:
        time.sleep(0.05)
    sock.close(0)
    context.term()
    assert cpu_pool._transport.dropped == before + 1
    assert cpu_pool.run("rank") == {0: 0, 1: 1}


def test_status_reports_every_rank(cpu_pool):
    rows = cpu_pool.status()
    assert [r["rank"] for r in rows] == [0, 1]
    assert all(r["state"] == "idle" and r["memory_bytes"] > 0 for r in rows)


def test_hang_times_out_with_stacks_and_the_next_cell_runs_on_restarted_ranks(cpu_pool):
    pool, restarts = cpu_pool, cpu_pool.restarts
    with pytest.raises(CellTimeoutError) as info:
        pool.run("x = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(x)", timeout=2)
    message = str(info.value)
    assert "rank(s) [0] had not finished" in message
    assert "dist.all_reduce(x)" in message and "in all_reduce" in message
    assert "rank(s) [1] had finished" in message
    assert 0 in info.value.stacks
    assert "restarting all 2 ranks" in message and "names defined in earlier cells are gone" in message
    old = pool.pids()
    assert pool.run("rank") == {0: 0, 1: 1}  # no %mnb restart needed: the next cell waits for new ranks
    assert pool.restarts == restarts + 1 and set(pool.pids()).isdisjoint(old)
    assert_no_orphans(old)
    started = time.monotonic()
    with pytest.raises(RankDiedError) as died:
        pool.run("import os, time\nif rank == 1:\n    os._exit(3)\ntime.sleep(60)")
    assert time.monotonic() - started < 60  # seen as it happened, not when rank 0's sleep ended
    assert "exit code 3" in died.value.deaths[1]
    assert "restarting all 2 ranks" in str(died.value)
    assert pool.run("rank") == {0: 0, 1: 1}


def test_segfault_is_reported_with_its_signal(cpu_pool):
    with pytest.raises(RankDiedError) as died:
        cpu_pool.run("import ctypes, time\nif rank == 0:\n    ctypes.string_at(0)\ntime.sleep(60)")
    assert "SIGSEGV" in died.value.deaths[0]
    report = str(died.value)  # the line it crashed on, from its fault handler (a crash sends no message)
    assert "rank 0's Python stack at the crash" in report and "Fatal Python error: Segmentation fault" in report
    assert "in string_at" in report
    assert "<cell-" in report and ", line 3 in <module>: ctypes.string_at(0)" in report
    assert cpu_pool.run("rank") == {0: 0, 1: 1}


def test_second_thread_is_refused_while_a_request_runs(cpu_pool, tmp_path):
    import threading

    errors = []
    running = threading.Event()  # set from the background request's wait: it holds the pool
    release = tmp_path / "release"  # the background cell runs until the main thread made its attempt

    def on_event(rank: int, kind: str, payload: dict) -> None:
        if kind == "test-running":
            running.set()

    cell = (f"from mnb.megatron import events\nimport os, time\nevents.emit('test-running', {{}})\n"
            f"while not os.path.exists({str(release)!r}):\n    time.sleep(0.02)")
    cpu_pool.event_handlers.append(on_event)
    worker = threading.Thread(target=lambda: cpu_pool.run(cell, quiet=True, timeout=120), name="bg")
    worker.start()
    try:
        assert running.wait(60), "the background request never started"
        try:
            cpu_pool.run("1")
        except PoolError as exc:
            errors.append(str(exc))
    finally:
        release.touch()
        worker.join()
        cpu_pool.event_handlers.remove(on_event)
    assert errors and "busy with a request from another thread (run in bg)" in errors[0]
    assert cpu_pool.run("rank") == {0: 0, 1: 1}


def test_more_ranks_than_the_machine_holds_are_refused_before_launch():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=r"-n 100000 is more CPU ranks than this machine can hold: .* use -n \d+"):
        Pool.start(100000, device="cpu")
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # no torchrun was started


def test_the_pools_sockets_listen_on_loopback_only(cpu_pool):
    listening = []
    for pid in cpu_pool.descendants():
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listening.append((pid, conn.laddr.ip))
    assert listening, "torchrun's stores and gloo listen somewhere"
    assert {ip for _, ip in listening} == {"127.0.0.1"}, listening


def test_failure_in_a_collective_keeps_the_layout_across_the_automatic_restart(tmp_path):
    pool = Pool.start(2, device="cpu", timeout=180, workdir=tmp_path, grace=0.5)
    try:
        pool.run("pass", layout=ParallelConfig(tp=2))
        with pytest.raises(CompositeRankError) as info:  # not CellTimeoutError: the grace ended the wait
            pool.run("if rank == 1:\n    raise KeyError('lost')\ndist.barrier()", timeout=120)
        error = info.value
        assert error.root_cause.rank == 1 and error.root_cause.ename == "KeyError"
        assert list(error.waiting) == [0] and "dist.barrier()" in error.waiting[0]
        assert any("restarting all 2 ranks" in note for note in error.notes)
        assert pool.run("ps.get_tensor_model_parallel_world_size()") == {0: 2, 1: 2}
        assert pool.layout.tp == 2 and pool.restarts == 1
    finally:
        pool.stop()
    assert not (tmp_path / "pool.json").exists()  # the secret goes with the pool


def test_start_timings_cover_the_start_stage_by_stage(cpu_pool):
    text = cpu_pool.start_timings
    names = [line[2:].split("  ")[0] for line in text.splitlines()[2:]]
    # Megatron-Core's import begins in a helper thread right after torch's, beside the process group,
    # and may still run at the hello (mnb/worker/late_start.py); the default layout follows it there
    assert names[:3] == ["torchrun: agent, rendezvous, spawn", "interpreter and mnb.worker", "torch import"]
    assert sorted(names[3:5]) == ["Megatron-Core import and CPU redirection", "process group (gloo)"]
    assert names[5:] == ["hello reaches the notebook", "ready (every rank said hello)"], names
    rows = [re.match(r"  (.+?)  +(\d+\.\d\d)  +(\d+\.\d\d|\.\.\.)", line) for line in text.splitlines()[2:-1]]
    begins = [float(row[2]) for row in rows]
    assert begins == sorted(begins) and all(row[3] == "..." or float(row[3]) >= 0 for row in rows)
    ready = float(text.splitlines()[-1].split()[-1])
    assert begins[-1] <= ready <= cpu_pool.startup_s + 0.5  # the launch comes after the pool's own set-up


def test_a_cell_that_trains_twice_leaves_the_second_training_as_last_run(cpu_pool):
    import mnb

    cpu_pool.run("m = mnb.gpt('tiny', seed=3)\n"
                 "first = mnb.train(m, steps=2, micro_batch_size=1, global_batch_size=2)\n"
                 "second = mnb.train(m, steps=3, micro_batch_size=1, global_batch_size=2)", quiet=True)
    second = cpu_pool.pull("second")[0]
    run = mnb.last_run
    assert len(run.losses) == 3
    assert run.losses == pytest.approx([row["loss"] for row in second["steps"]])
    # the record reaches the kernel as the one-line mapping it is on the ranks (mnb.results)
    assert type(second).__name__ == "TrainResult" and second["losses"] == run.losses
    assert repr(second).startswith("<mnb.train rank 0 ") and "3 steps (3-5)" in repr(second)
    # every step number is the model's, from 1: steps 1-2, then 3-5 in the repr, the run, its summary, plots
    assert run.steps == [3, 4, 5] and "tokens/s (mean of steps 4-5)" in run.summary()
    assert "loss at each of steps 3-5" in run.plot_loss().get_title()
    assert [int(x) for x in run.plot_loss().lines[0].get_xdata()] == [3, 4, 5]
    assert run.lrs == second.lrs == [3e-4] * 3


def test_export_after_a_training_that_continued_carries_what_the_ranks_ran(cpu_pool, shell, capsys, monkeypatch):
    """The ranks' record is the only source of what a cell trained: a second mnb.train that continues the
    first trains with its lr, schedule and warm-up, and %mnb export says so (not the defaults that the
    second cell's text alone would give), and the .bin/.idx its ranks tokenized the text into.  The text
    counts only for a cell that trained nothing."""
    from mnb.controller import registry

    monkeypatch.setattr(registry, "_SETTINGS", {})
    shell.run_cell_magic("megatron", "", "model = mnb.gpt('tiny', num_layers=1, hidden_size=64, ffn_hidden_size=128, "
                                         "seq_length=32)\n"
                                         "mnb.train(model, steps=5, lr=1e-3, schedule_steps=10, warmup_steps=2, "
                                         "lr_decay_style='cosine', micro_batch_size=1, global_batch_size=2, "
                                         "data='stdlib-small')")
    shell.run_cell_magic("megatron", "", "mnb.train(model, steps=5)")

    def exported() -> dict[str, str]:
        capsys.readouterr()
        shell.run_line_magic("mnb", "export --gpus-per-node 2")
        words = [w for w in capsys.readouterr().out.split() if w != "\\"]
        return {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}

    got = exported()
    assert (got["--lr"], got["--lr-decay-style"], got["--lr-warmup-iters"]) == ("0.001", "cosine", "2"), got
    assert (got["--train-iters"], got["--lr-decay-iters"], got["--num-layers"]) == ("10", "10", "1"), got
    prefix = mnb.last_run.records[0]["data_prefix"]
    assert got["--data-path"] == prefix and os.path.basename(prefix).startswith("stdlib-small-"), (got, prefix)
    assert os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx") and "--mock-data" not in got
    # a cell that trains nothing: its literal mnb.gpt(...) is the model to export, the training stays the ranks'
    shell.run_cell_magic("megatron", "", "other = mnb.gpt('tiny', num_layers=2, hidden_size=64, ffn_hidden_size=128, "
                                         "seq_length=32)")
    got = exported()
    assert (got["--num-layers"], got["--lr"], got["--train-iters"]) == ("2", "0.001", "10"), got


def test_a_training_step_that_raises_gives_back_its_activations(cpu_pool):
    """A forward that fails (out of memory on a GPU) in the steps where mnb counts saved tensors:
    nothing it saved stays alive, and no saved-tensor hook is left on autograd's stack."""
    cpu_pool.run("""
import gc
model = mnb.gpt('tiny', seq_length=128)
layer = model.chunks[0].decoder.layers[-1]
calls, forward = [0], layer.forward
def failing_forward(*args, **kwargs):
    calls[0] += 1
    if calls[0] > 2:  # step 0's second microbatch
        raise torch.OutOfMemoryError("provoked out of memory")
    return forward(*args, **kwargs)
layer.forward = failing_forward
def activations_alive():
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)
               and not isinstance(o, torch.nn.Parameter) and o.dim() == 3 and o.shape[0] == 128)
""", quiet=True)
    with pytest.raises(CompositeRankError, match="out of memory"):
        cpu_pool.run("mnb.train(model, steps=3, micro_batch_size=2, global_batch_size=4)", quiet=True)
    left = cpu_pool.run("layer = forward = failing_forward = model = None\n"
                        "(activations_alive(), torch._C._autograd._top_saved_tensors_default_hooks(False) is None)")
    assert left == {0: (0, True), 1: (0, True)}


def test_a_rank_failing_inside_pipeline_training_is_reported_without_waiting_for_the_step(cpu_pool):
    """Rank 1 raises in mnb.train under pp2 while rank 0 waits for its activations' gradient
    (gloo's recv, which no interrupt releases): the error comes after the grace period, not after
    the time an interrupted mnb.train would get to finish its step, and the pool recovers."""
    cpu_pool.run("model = mnb.gpt('tiny')", layout=ParallelConfig(pp=2), quiet=True)
    cpu_pool.run("if rank == 1:\n"
                 "    layer = model.chunks[0].decoder.layers[-1]\n"
                 "    def failing_forward(*args, **kwargs):\n"
                 "        raise ValueError('stage 1 failed')\n"
                 "    layer.forward = failing_forward", quiet=True)
    started = time.monotonic()
    with pytest.raises(CompositeRankError, match="stage 1 failed") as error:
        cpu_pool.run("mnb.train(model, steps=5, micro_batch_size=1, global_batch_size=4)", quiet=True)
    assert time.monotonic() - started < cpu_pool.grace_s + 30  # not DEFERRED_STOP_S (300 s)
    assert "[r1" in str(error.value).splitlines()[1]  # the root cause first
    assert cpu_pool.run("rank * 2") == {0: 0, 1: 2}  # after the automatic restart


def test_bf16_training_on_cpu_ranks_reports_an_mfu_below_one(cpu_pool):
    """The CPU peak for bf16 is the better of fp32 and bf16 matmuls (a slow bf16 probe read 138 %)."""
    import mnb

    cpu_pool.run("mnb.train(mnb.gpt('tiny'), steps=3, micro_batch_size=2, global_batch_size=8, bf16=True)",
                 quiet=True)
    run = mnb.last_run
    assert "best of float32, bfloat16" in run.peak_source
    assert all(0 < m < 1 for m in run.mfu[1:]), run.mfu


def test_a_start_that_times_out_keeps_its_log_and_loses_its_secret():
    """A start past its --timeout names torchrun's log: the log is still there to read (the folder went with
    it), the connection file (the pool's secret) is gone, and no process of it is left."""
    import shutil
    from pathlib import Path

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(PoolError) as info:
        Pool.start(2, device="cpu", timeout=0.5)
    message = str(info.value)
    assert "only 0 of 2 ranks were ready after 0.5 s; raise --timeout, or read the log " in message, message
    log = Path(re.search(r"read the log (\S+torchrun\.log)", message).group(1))
    try:
        assert log.is_file() and not (log.parent / "pool.json").exists()
        wait_for = time.monotonic() + 30
        while {p.pid for p in psutil.Process().children(recursive=True)} - before and time.monotonic() < wait_for:
            time.sleep(0.1)
        assert not {p.pid for p in psutil.Process().children(recursive=True)} - before
    finally:
        shutil.rmtree(log.parent, ignore_errors=True)
