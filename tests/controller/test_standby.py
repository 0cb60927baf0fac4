"""Standby ranks (issue 27): adopted by restarts and by a start after a stop, discarded when
settings changed, replaced when dead, and never left behind by a killed kernel."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mnb.controller import Pool
from mnb.controller import standby as standbys
from mnb.controller import registry
from mnb.errors import PoolError
from mnb.notebook.magics import MegatronMagics
from tests.conftest import alive_pids
from tests.controller.test_orphans import wait_gone

pytestmark = pytest.mark.slow


def waiting(pool: Pool, timeout_s: float = 180) -> dict:
    """The pool's standby once every rank waits for go."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = pool.standby_status()
        assert status is not None, "the pool has no standby"
        if status["state"] == "waiting for go":
            return status
        assert status["state"] in ("launching", standbys.DEFERRED), status
        time.sleep(0.2)
    raise AssertionError(f"the standby was not ready in {timeout_s} s: {pool.standby_status()}")


def torchrun_of_standby(pool: Pool) -> int:
    """The standby's torchrun pid once it runs (its ranks may still be importing)."""
    deadline = time.monotonic() + 60
    while pool.standby_status()["torchrun_pid"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return pool.standby_status()["torchrun_pid"]


def rank_pids(pool: Pool) -> list[int]:
    return [info.pid for _, info in sorted(pool.ranks.items())]


@pytest.fixture(scope="module")
def pool():
    pool = Pool.start(2, device="cpu", standby="on", timeout=180)
    yield pool
    pool.stop()


def test_restart_after_killed_rank_adopts_the_standby(pool, capsys):
    status = waiting(pool)
    assert len(status["pids"]) == 2 and alive_pids(status["pids"]) == status["pids"]
    assert status["rss_bytes"] > 100 * 2**20  # torch and Megatron-Core imported: host memory only
    MegatronMagics(shell=None)._cmd_status(argparse.Namespace(), pool)  # what %mnb status prints
    assert (f"standby: waiting for go; pids {status['pids'][0]} {status['pids'][1]} "
            f"(torchrun {status['torchrun_pid']}); host memory ") in capsys.readouterr().out
    with pytest.raises(PoolError):
        pool.run("import os, signal\nif rank == 1: os.kill(os.getpid(), signal.SIGKILL)\nimport time; time.sleep(60)",
                 timeout=120)
    pool.run("x = rank * 3")  # waits for the automatic restart
    assert rank_pids(pool) == status["pids"]  # started before the failure
    assert pool.start_note == "adopted the standby" and pool.restarts == 1
    assert pool.pull("x") == {0: 0, 1: 3}
    pool.restart()  # at once, while the next standby imports: adopting it waits, and the line says so
    assert re.fullmatch(r"adopted the standby \(it was still importing: waited \d+\.\d s for it\)",
                        pool.start_note), pool.start_note
    assert waiting(pool)["pids"] != status["pids"]


def test_a_standby_that_died_is_replaced_not_adopted(pool):
    dead = waiting(pool)["pids"]
    os.kill(dead[0], signal.SIGKILL)
    pool.restart()
    assert "ended on its own" in pool.start_note and not set(rank_pids(pool)) & set(dead)
    assert pool.run("rank + 1") == {0: 1, 1: 2}


def test_killed_kernel_leaves_no_standby():
    script = ("import json, time\nfrom mnb.controller import Pool\n"
              "pool = Pool.start(2, device='cpu', standby='on', timeout=180)\n"
              "from mnb.controller.standby import DEFERRED\n"
              "while pool.standby_status()['state'] in ('launching', DEFERRED): time.sleep(0.2)\n"
              "s = pool.standby_status()\nprint(json.dumps(s['pids'] + [s['torchrun_pid']] + pool.pids()), flush=True)\n"
              "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = json.loads(proc.stdout.readline())
    assert len(pids) == 6 and alive_pids(pids) == pids
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    left = wait_gone(pids)  # each pid gone: the standby noticed the kernel's death
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


def test_stop_and_start_adopt_it_unless_settings_changed(pool):
    pids = waiting(pool)["pids"]
    pool.stop()  # last test of the shared pool: the fixture's stop is then a no-op
    again = Pool.start(2, device="cpu", standby="on", timeout=180)
    assert rank_pids(again) == pids and again.start_note == "adopted the standby"
    old = torchrun_of_standby(again)  # still launching: a standby in any state is discarded
    again.stop()
    os.environ["MNB_STANDBY_TEST"] = "1"
    try:
        changed = Pool.start(2, device="cpu", standby="on", timeout=180)
    finally:
        del os.environ["MNB_STANDBY_TEST"]
    assert "discarded the standby" in changed.start_note and "environment (MNB_STANDBY_TEST)" in changed.start_note
    assert wait_gone([old]) == [] and not set(rank_pids(changed)) & set(pids)
    old = torchrun_of_standby(changed)
    changed.stop()
    smaller = Pool.start(1, device="cpu", standby="off", timeout=180)
    try:
        assert "discarded the standby" in smaller.start_note and "-n 2 -> 1" in smaller.start_note
        assert smaller.standby_status() is None and wait_gone([old]) == []  # off: none starts
        assert smaller.run("rank") == {0: 0}
    finally:
        smaller.stop()


def test_what_auto_chooses():
    cores = len(os.sched_getaffinity(0))
    on, why = standbys.choose("auto", "cpu", cores, several_hosts=False)  # never spare cores for a full machine
    assert not on and why.startswith("auto chose off") and f"{cores} cores" in why
    assert standbys.choose("auto", "cuda", 8, several_hosts=False) == (True, "auto chose on: a CUDA pool "
                                                                              "(a standby holds host memory only)")
    assert standbys.choose("auto", "cuda", 8, several_hosts=True)[0] is False
    with pytest.raises(ValueError, match="--standby on needs a pool on this host"):
        standbys.choose("on", "cpu", 2, several_hosts=True)
    with pytest.raises(ValueError, match="use one of off, on, auto"):
        standbys.choose("maybe", "cpu", 2, several_hosts=False)


def test_load_ext_begins_a_standby_that_the_first_start_adopts(monkeypatch, capsys):
    """``%load_ext mnb`` (GPU machines; ``MNB_STANDBY_AT_LOAD=1`` forces it here) launches the standby
    that a bare first ``%mnb start`` adopts; ``0`` starts none; a typo is refused."""
    from IPython.core.interactiveshell import InteractiveShell

    from mnb.controller import load_standby

    ip = InteractiveShell.instance()
    monkeypatch.setenv("MNB_STANDBY_AT_LOAD", "0")
    ip.run_line_magic("reload_ext", "mnb")  # load_ipython_extension again, whatever loaded it before
    assert standbys.unpark() is None and "standby" not in capsys.readouterr().out
    monkeypatch.setenv("MNB_STANDBY_AT_LOAD", "sometimes")
    with pytest.raises(ValueError, match="MNB_STANDBY_AT_LOAD='sometimes': use auto"):
        load_standby.wanted()
    monkeypatch.setenv("MNB_STANDBY_AT_LOAD", "1")
    ip.run_line_magic("reload_ext", "mnb")
    assert "mnb: launching standby ranks for the first %mnb start (MNB_STANDBY_AT_LOAD=0" in capsys.readouterr().out
    deadline = time.monotonic() + 180
    while (status := standbys.parked_status()) is None or status["state"] == "launching":
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    assert status["state"] == "waiting for go" and len(status["pids"]) == 2
    ip.run_line_magic("mnb", "status")
    assert "no pool; start one with %mnb start (it adopts the standby: waiting for go" in capsys.readouterr().out
    ip.run_line_magic("mnb", "start --standby on")  # the defaults on this CPU machine: 2 CPU ranks
    pool = registry.current_pool()
    try:
        assert "2 ranks ready in" in capsys.readouterr().out and pool.start_note == "adopted the standby"
        assert rank_pids(pool) == status["pids"] and pool.run("rank * 2") == {0: 0, 1: 2}
    finally:
        ip.run_line_magic("mnb", "stop")
        parked = standbys.unpark()  # the pool's own next standby, kept by the stop
        if parked is not None:
            parked.close()
    assert wait_gone(status["pids"]) == []
