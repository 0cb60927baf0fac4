"""How a rank ended comes from torchrun's own record (written by mnb.worker.agent), never its log text."""

from __future__ import annotations

import types

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
