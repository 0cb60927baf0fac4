"""A pool is ready before its ranks finish importing Megatron-Core (``mnb/worker/late_start.py``).

Each test starts a pool of its own (the shared pools finished their imports long ago) whose ranks
import Megatron-Core through a package put ahead of it on their path: it holds the import until the
test creates a file (and, for one rank, then fails it), so the order of events is exact: the test
acts on the ranks' own ``starting`` events, never on sleeps.
"""

from __future__ import annotations

import _thread
import os
import re
import threading
import textwrap
import time
from pathlib import Path

import pytest

from mnb.config import ParallelConfig
from mnb.controller import Pool
from mnb.controller import standby as standbys
from mnb.errors import RankDiedError

pytestmark = pytest.mark.slow

GATE_ENV = "MNB_TEST_MEGATRON_GATE"
FAIL_ENV = "MNB_TEST_MEGATRON_FAILS_ON_RANK"
HELD_MEGATRON = textwrap.dedent(f'''
    """Megatron-Core's ``megatron`` (a namespace package) behind a gate: the test opens it (a file)."""
    import os, pkgutil, time

    __path__ = pkgutil.extend_path(__path__, __name__)  # megatron.core: the installed one
    while not os.path.exists(os.environ["{GATE_ENV}"]):
        time.sleep(0.05)  # this rank's import waits for the test, in the rank's helper thread
    if os.environ.get("{FAIL_ENV}") == os.environ["RANK"]:
        raise ImportError("rank " + os.environ["RANK"] + " cannot import megatron (the test's gate failed it)")
''')


HOLD_ENV, HELD_ENV, RELEASE_ENV = "MNB_TEST_LAYOUT_HELD_ON_RANK", "MNB_TEST_LAYOUT_HELD", "MNB_TEST_LAYOUT_RELEASE"
HELD_LAYOUT = textwrap.dedent(f'''
    if os.environ.get("{HOLD_ENV}") == os.environ["RANK"]:  # this rank stops once its default layout is built
        from mnb.worker import late_start

        _lay_out = late_start.LateStart._lay_out

        def _held_lay_out(self):
            _lay_out(self)
            open(os.environ["{HELD_ENV}"], "w").close()
            while not os.path.exists(os.environ["{RELEASE_ENV}"]):
                time.sleep(0.05)

        late_start.LateStart._lay_out = _held_lay_out
''')


def held_megatron(folder: Path, gate: Path, fails_on_rank: int | None = None,
                  hold_layout: tuple[int, Path, Path] | None = None) -> dict[str, str]:
    """The ranks' extra environment: ``megatron`` imported through the gate ``gate`` (a file to create);
    ``hold_layout=(rank, held, release)``: that rank writes ``held`` once its default layout is built and
    goes on once ``release`` exists."""
    (folder / "megatron").mkdir()
    (folder / "megatron" / "__init__.py").write_text(HELD_MEGATRON + (HELD_LAYOUT if hold_layout else ""))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p),
           GATE_ENV: str(gate)}
    if fails_on_rank is not None:
        env[FAIL_ENV] = str(fails_on_rank)
    if hold_layout is not None:
        rank, held, release = hold_layout
        env.update({HOLD_ENV: str(rank), HELD_ENV: str(held), RELEASE_ENV: str(release)})
    return env


def on_event(pool: Pool, kind: str, act, ranks: int = 1):
    """Call ``act()`` once when ``ranks`` ranks sent events of ``kind``; returns the event that says it did."""
    seen: set[int] = set()
    done = threading.Event()

    def handler(rank: int, event_kind: str, payload: dict) -> None:
        if event_kind == kind and not done.is_set():
            seen.add(rank)
            if len(seen) >= ranks:
                done.set()
                act()

    pool.event_handlers.append(handler)
    return done


def test_the_pool_is_ready_before_megatron_is_imported_and_the_first_cell_waits_and_says_so(tmp_path, capsys):
    gate = tmp_path / "open"
    pool = Pool.start(2, device="cpu", standby="on", timeout=180, extra_env=held_megatron(tmp_path, gate))
    try:
        pids = [info.pid for _, info in sorted(pool.ranks.items())]
        states = [row["state"] for row in pool.status()]  # the gate is shut: no rank can have imported it
        assert all(re.fullmatch(r"idle: importing Megatron-Core, \d+\.\d s so far", s) for s in states), states
        # the next generation's imports would compete with these for the cores: it waits for them
        deadline = time.monotonic() + 120
        while pool.standby_status()["state"] == "launching" and time.monotonic() < deadline:
            time.sleep(0.1)  # its thread has begun and asked the ranks
        assert pool.standby_status()["state"] == standbys.DEFERRED, pool.standby_status()
        assert pool.standby_status()["torchrun_pid"] is None
        assert pool.pull("rank") == {0: 0, 1: 1}  # ready: the ranks answer requests
        assert "Megatron-Core import and CPU redirection" in pool.start_timings
        assert "still running at the hello" in pool.start_timings

        # Kernel -> Interrupt while the cell waits: the cell ends, the ranks stay and go on importing
        interrupted = on_event(pool, "starting", _thread.interrupt_main, ranks=2)
        with pytest.raises(KeyboardInterrupt):
            pool.run("dp = ps.get_data_parallel_world_size()")
        assert interrupted.is_set()
        out = capsys.readouterr().out
        assert re.search(r"mnb: waiting for the ranks to finish importing Megatron-Core "
                         r"\(under way for \d+\.\d s\)\.\.\.", out), out
        assert pool.restarts == 0 and [info.pid for _, info in sorted(pool.ranks.items())] == pids
        assert all(row["state"].startswith("idle: importing Megatron-Core") for row in pool.status())
        pool.event_handlers.clear()

        # the next cell waits, says so once, and runs once the import is done (here: the gate opened)
        opened = on_event(pool, "starting", gate.touch)
        assert pool.run("ps.get_data_parallel_world_size()", timeout=5) == {0: 2, 1: 2}  # the wait is not the cell's
        assert opened.is_set()
        out = capsys.readouterr().out
        assert out.count("mnb: waiting for the ranks to finish importing Megatron-Core") == 1, out
        assert [row["state"] for row in pool.status()] == ["idle", "idle"]
        assert pool.restarts == 0 and [info.pid for _, info in sorted(pool.ranks.items())] == pids
        assert pool.run("mnb.gpt('tiny').__class__.__name__", quiet=True)[0]  # Megatron-Core serves
        assert "waiting for the ranks" not in capsys.readouterr().out  # ready: no cell waits again
        deadline = time.monotonic() + 120  # the standby launches once the ranks say they are ready
        while pool.standby_status()["torchrun_pid"] is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.standby_status()["torchrun_pid"] is not None, pool.standby_status()
    finally:
        pool.stop()
        parked = standbys.unpark()  # Pool.stop keeps the standby for a later start in this process
        if parked is not None:
            parked.close()


def test_a_rank_whose_megatron_import_fails_after_its_hello_is_a_crashed_rank_named_with_the_error(tmp_path):
    gate = tmp_path / "open"
    pool = Pool.start(2, device="cpu", standby="off", timeout=180,
                      extra_env=held_megatron(tmp_path, gate, fails_on_rank=1))
    try:
        on_event(pool, "starting", gate.touch)
        with pytest.raises(RankDiedError) as info:
            pool.run("ps.get_data_parallel_world_size()", timeout=300)
        message = str(info.value)
        assert re.search(r"rank 1 \(r1 [^)]*\) died: exit code 1 \(pid \d+\); its start failed after it said "
                         r"hello: importing Megatron-Core raised ImportError: rank 1 cannot import megatron "
                         r"\(the test's gate failed it\)", message), message
        assert "rank 1's traceback" in message and "megatron/__init__.py" in message, message
    finally:
        pool.stop()


def test_no_rank_is_ready_before_every_rank_built_the_default_layout(tmp_path, capsys):
    """A CI run's first cell (``--pp 2``) found rank 1 dead: "Gloo connectFullMesh failed ... Connection
    closed by peer". Rank 0 had finished its default layout, taken the cell's layout and destroyed
    Megatron's gloo groups while rank 1 still shook hands on the last of them. Held here, exactly:
    rank 1 stops once its default layout is built; rank 0 must not be ready before it goes on."""
    gate, held, release = tmp_path / "open", tmp_path / "held", tmp_path / "release"
    gate.touch()
    pool = Pool.start(2, device="cpu", standby="off", timeout=180,
                      extra_env=held_megatron(tmp_path, gate, hold_layout=(1, held, release)))
    try:
        deadline = time.monotonic() + 300
        while not held.exists():
            assert time.monotonic() < deadline, f"rank 1 never built its default layout: {pool.status()}"
            time.sleep(0.05)
        states = [row["state"] for row in pool.status()]
        assert re.fullmatch(r"idle: waiting for the other ranks' default layout, \d+\.\d s so far", states[0]), states
        assert re.fullmatch(r"idle: building Megatron's default layout, \d+\.\d s so far", states[1]), states
        # the first cell, in another layout, arrives while rank 1 is held: it waits, says for what, and runs
        # once rank 1 goes on, with the default's groups complete on every rank
        on_event(pool, "starting", release.touch, ranks=2)
        assert pool.run("ps.get_pipeline_model_parallel_world_size()", layout=ParallelConfig(pp=2),
                        timeout=120) == {0: 2, 1: 2}
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("mnb: waiting")]
        assert len(said) == 1 and re.fullmatch(  # the first rank's event: rank 0 waits, rank 1 builds
            r"mnb: (waiting for the other ranks' default layout|waiting for the ranks to finish building "
            r"Megatron's default layout) \(under way for \d+\.\d s\)\.\.\.", said[0]), said
        assert pool.restarts == 0
        assert [row["state"] for row in pool.status()] == ["idle", "idle"]
    finally:
        pool.stop()
