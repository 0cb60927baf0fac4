"""How a rank ended comes from torchrun's own record (written by mnb.worker.agent), never its log text."""

from __future__ import annotations

import subprocess
import threading
import types

import psutil
import pytest

from mnb.controller.launcher import LaunchSpec, Launcher
from mnb.protocol import EXITS_DIR_ENV
from mnb.worker.agent import write_exits


def _spec(tmp_path, **kw) -> LaunchSpec:
    return LaunchSpec(nproc_per_node=2, device="cpu", connection_file=tmp_path / "pool.json",
                      log_file=tmp_path / "torchrun.log", **kw)


def test_deaths_come_from_the_agents_record_of_torchruns_failures(tmp_path):
    spec = _spec(tmp_path)
    failures = {1: types.SimpleNamespace(exitcode=-9, pid=42), 0: types.SimpleNamespace(exitcode=3, pid=7)}
    write_exits(failures, spec.exits_dir)
    spec.log_file.write_text("rank : 0 (local_rank: 0)\n  exitcode : -11 (pid: 99)\n")  # log text is not read
    launcher = Launcher(spec)
    assert launcher.failures() == {0: "exit code 3 (pid 7)", 1: "killed by signal SIGKILL (pid 42)"}
    launcher.forget_exits()  # a restart in the same folder starts clean
    assert launcher.failures() == {}


def test_torchrun_runs_through_the_agent_which_is_told_where_to_record(tmp_path):
    one_host = _spec(tmp_path)
    command = one_host.command()
    assert command[1:4] == ["-m", "mnb.worker.agent", "--loopback-stores"]
    assert one_host.environment()[EXITS_DIR_ENV] == str(one_host.exits_dir)
    several = _spec(tmp_path, nnodes=2, rdzv_endpoint="127.0.0.1:29400").command()
    assert several[1:3] == ["-m", "mnb.worker.agent"] and "--loopback-stores" not in several


@pytest.fixture
def sleepers():
    """Two processes in sessions of their own, standing in for ranks; killed at the end whatever happens."""
    procs = [subprocess.Popen(["sleep", "120"], start_new_session=True) for _ in range(2)]
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def _running(proc: subprocess.Popen) -> bool:
    """Still running (the stop's psutil.wait_procs reaped it otherwise, so Popen sees no exit status)."""
    try:
        return psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _interleave(monkeypatch, pid: int, other) -> list[BaseException]:
    """Run ``other`` in a second thread, to its end, the first time the launcher walks rank ``pid``'s children.

    That is the moment a stop is inside its loop over the rank table: what the second thread does then
    is what a background restart (Repair._relaunch) can do at the same point.
    """
    original = psutil.Process.children
    errors: list[BaseException] = []
    done = threading.Event()

    def run_other() -> None:
        try:
            other()
        except BaseException as err:  # reported by the test, not lost in the thread
            errors.append(err)

    def children(self, *args, **kwargs):
        if self.pid == pid and not done.is_set():
            done.set()
            thread = threading.Thread(target=run_other)
            thread.start()
            thread.join()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(psutil.Process, "children", children)
    return errors


def test_a_rank_adopted_while_the_pool_stops_is_stopped_too(tmp_path, monkeypatch, sleepers):
    """Pool.stop() during a background restart: the restart's hello wait adopts a rank mid-stop."""
    launcher = Launcher(_spec(tmp_path))
    launcher.adopt(0, sleepers[0].pid, True)
    errors = _interleave(monkeypatch, sleepers[0].pid, lambda: launcher.adopt(1, sleepers[1].pid, True))
    launcher.stop(grace_s=0)  # raised 'dictionary changed size during iteration' when adopt() mutated the table
    assert errors == []
    assert not any(map(_running, sleepers))  # the late rank too: a stop looks for processes again at its end
    assert launcher.all_pids() == []


def test_two_stops_at_once_each_walk_a_table_the_other_never_changes(tmp_path, monkeypatch, sleepers):
    """The restart thread tears the old ranks down while Pool.stop() (its cancel) stops the same launcher."""
    launcher = Launcher(_spec(tmp_path))
    for rank, proc in enumerate(sleepers):
        launcher.adopt(rank, proc.pid, True)
    errors = _interleave(monkeypatch, sleepers[0].pid, lambda: launcher.stop(grace_s=0))
    launcher.stop(grace_s=0)  # the other stop emptied the table under this one's loop
    assert errors == []
    assert not any(map(_running, sleepers))
