"""Profiles of real tp2 and pp2 trainings on a 2-rank CPU pool, merged on the shared clock (mnb.profiles)."""

from __future__ import annotations

import json

import pytest
from IPython.core.error import UsageError

import mnb
from mnb.errors import CompositeRankError
from mnb.notebook.profiles import Profile

pytestmark = pytest.mark.slow

TRAIN = ("model = mnb.gpt('tiny', num_layers=1, hidden_size=64, ffn_hidden_size=128, seq_length=32)\n"
         "mnb.train(model, steps=3, micro_batch_size=2, global_batch_size=2, data='mock')")
STILL_RUNNING = ("import torch, torch.distributed as dist\n"
                 "(torch._C._autograd._profiler_enabled(), dist.all_reduce.__module__)")


def assert_no_profiler(pool):
    """No profiler on and torch.distributed's functions unwrapped, on every rank."""
    for on, module in pool.run(STILL_RUNNING).values():
        assert on is False and not module.startswith("mnb"), (on, module)


def test_tp2_training_profile_merged_on_one_clock(cpu_pool, shell, capsys):
    shell.run_cell_magic("megatron", "--tp 2 --profile 2-3", TRAIN)
    captured = capsys.readouterr()
    out = captured.out
    # Kineto's own lines (USDT: profiler_start, STAGE: ...) are silenced on the ranks, not filtered here
    assert not [line for line in (out + captured.err).splitlines() if "USDT:" in line or "STAGE:" in line]
    prof = mnb.last_profile
    assert prof is not None and prof.folder.parent == cpu_pool.workdir() / "profiles"
    assert str(prof.path) in out and "communication" in out  # shown after the cell, after mnb.last_run's
    merged = json.loads(prof.path.read_text())  # valid JSON
    pids = {e["pid"] for e in merged["traceEvents"] if e.get("ph") == "X"}
    assert pids == {0, 1} and prof.ranks == [0, 1]
    assert all(prof.rank_events(r) for r in (0, 1))
    # steps 2 and 3 of the call (model steps 1 and 2), on both ranks
    assert [len(prof.steps(r)) for r in (0, 1)] == [2, 2]
    # each tp all-reduce appears on both ranks, in the same order, windows overlapping on the shared clock
    tp = {r: [c for c in prof.collectives(r) if c["group"] == "tp" and c["op"] == "all_reduce"] for r in (0, 1)}
    assert tp[0] and len(tp[0]) == len(tp[1])
    for a, b in zip(tp[0], tp[1]):
        assert a["bytes"] == b["bytes"] > 0
        assert a["start_us"] <= b["end_us"] and b["start_us"] <= a["end_us"], (a, b)
    for rank, shares in prof.shares().items():
        parts = [shares["compute"], shares["communication"], shares["idle"]]
        assert all(0.0 <= x <= 1.0 for x in parts + [shares["overlap"]]), shares
        assert sum(parts) == pytest.approx(1.0)
        assert shares["compute"] > 0 and shares["communication"] > 0
    rows = prof.table()
    assert {r["rank"] for r in rows} == {0, 1} and all(r["self_us"] >= 0 for r in rows)
    text = prof.summary()
    assert "profiled step" in text and "per-rank traces" in text
    assert set(prof.step_cost_s()) == {0, 1}
    fig = prof.plot()
    assert fig.axes[0].get_xlim()[1] - fig.axes[0].get_xlim()[0] == pytest.approx(
        (prof.steps(0)[0][1] - prof.steps(0)[0][0]) / 1e3)
    # a row per thread with events in the step (no empty pt_gloo_runloop rows), each with its bars
    ax = fig.axes[0]
    rows = list(zip(ax.collections[::2], ax.collections[1::2]))  # (compute, collectives) bars per row
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(rows) == len(labels) > 0
    assert all(len(compute.get_paths()) + len(comm.get_paths()) > 0 for compute, comm in rows), labels
    # the training's tokens/s: steps 2-3, both profiled, and the summary says so
    assert mnb.last_run.profiled_steps == [2, 3]
    assert "tokens/s (mean of steps 2-3, all profiled (slowed by the profiler))" in mnb.last_run.summary()
    shell.run_line_magic("mnb", "profile")
    assert str(prof.folder) in capsys.readouterr().out
    shell.run_line_magic("mnb", "profile open")
    assert "ui.perfetto.dev" in capsys.readouterr().out
    # no profiler left on and torch.distributed unwrapped
    assert_no_profiler(cpu_pool)
    # Holistic Trace Analysis reads the per-rank folder and parses every rank
    from hta.trace_analysis import TraceAnalysis  # a test dependency (mnb[test]) in both legs

    analyzer = TraceAnalysis(trace_dir=str(prof.trace_dir))
    assert sorted(analyzer.t.traces) == [0, 1]


def test_profile_rank_one_only_and_a_raising_cell(cpu_pool, shell, tmp_path):
    shell.run_cell_magic("megatron", f"--tp 2 --profile 2 --profile-ranks 1 --memory -o {tmp_path}", TRAIN)
    prof = mnb.last_profile
    assert prof.folder.parent == tmp_path and prof.ranks == [1] and len(prof.steps(1)) == 1
    assert not (prof.trace_dir / "rank-0.trace.json").exists()
    # memory over the profiled step: its peak is mnb.last_run's measured one (counted tensors on CPU)
    memory = prof.memory()
    assert list(memory) == [1] and memory[1]["peak_bytes"] == mnb.last_run.peak_memory_bytes[1]
    assert max(memory[1]["activations"]) > 0 and memory[1]["activations"][-1] == 0  # freed by backward
    fig = prof.plot_memory()
    ax = fig.axes[0]
    marker = next(line for line in ax.get_lines() if str(line.get_label()).startswith("peak"))
    assert ax.get_ylabel() == "MiB (counted tensors)"  # the figure's peak: the same bytes, in its units
    assert marker.get_ydata()[0] * 2**20 == pytest.approx(mnb.last_run.peak_memory_bytes[1], rel=1e-12)
    with pytest.raises(UsageError, match=r"--profile-ranks 2: rank\(s\) \[2\] not in this pool"):
        shell.run_cell_magic("megatron", "--profile --profile-ranks 2", "pass")
    with pytest.raises(UsageError, match="only apply with --profile"):
        shell.run_cell_magic("megatron", "--profile-ranks 1", "pass")
    shell.run_line_magic("mnb", f"profile delete {prof.folder}")
    assert not prof.folder.exists() and mnb.last_profile is None
    # a profiled cell that raises on one rank: the usual composite error, no profiler left running
    bad = tmp_path / "p3"
    with pytest.raises(CompositeRankError, match="boom"):
        cpu_pool.run("if rank == 1:\n    raise ValueError('boom')\nx = 1", quiet=True,
                     profile={"dir": str(bad), "steps": None, "ranks": None})
    meta = json.loads((bad / "meta" / "rank-1.json").read_text())
    assert "boom" in meta["error"]
    assert_no_profiler(cpu_pool)
    # a second profiled cell works; mnb.train(profile=) names the steps inside it
    again = tmp_path / "p4"
    cpu_pool.run("mnb.train(model, steps=2, profile=1)", quiet=True,
                 profile={"dir": str(again), "steps": None, "ranks": None})
    assert [len(Profile(again).steps(r)) for r in (0, 1)] == [1, 1]
    with pytest.raises(CompositeRankError, match="steps count from 1"):
        cpu_pool.run("mnb.train(model, steps=1, profile='0-1')", quiet=True)
    before = mnb.last_profile
    with pytest.raises(CompositeRankError, match=r"the profile's steps 5-9 start after this call's 3 step\(s\), so "
                                                 r"nothing would be profiled: name steps of this call \(e.g. "
                                                 r"profile='2-3'"):
        cpu_pool.run("mnb.train(model, steps=3, profile='5-9')", quiet=True)  # it profiled nothing, silently
    assert mnb.last_profile is before
    # pp2, mnb.train(profile=) in a plain cell: into the cell's folder under the pool's, shown after the cell
    shell.run_cell_magic("megatron", "--pp 2", TRAIN.replace("steps=3", "steps=2, profile=2")
                         .replace("num_layers=1", "num_layers=2"))
    prof = mnb.last_profile
    assert prof.folder.name.startswith("cell-") and prof.ranks == [0, 1]
    pp = {r: [c for c in prof.collectives(r) if c["group"] == "pp" and c["bytes"] > 0] for r in (0, 1)}
    assert pp[0] and pp[1]
    first, last = pp[0][0], pp[1][0]  # stage 0 sends its first activations while stage 1 receives them
    assert first["bytes"] == last["bytes"]
    assert first["start_us"] <= last["end_us"] and last["start_us"] <= first["end_us"], (first, last)
    assert_no_profiler(cpu_pool)


def test_each_cell_shows_the_profile_folder_its_ranks_wrote(cpu_pool, shell, capsys):
    """The replies name the folder the ranks wrote: two profiled cells in quick succession each get their
    own, and a cell that profiled nothing right after them shows none.  No folder is guessed from
    modification times (here the first folder's are an hour ahead, as on a file server whose clock runs
    ahead of the kernel's)."""
    import os
    import time

    shell.run_cell_magic("megatron", "--tp 2", TRAIN.replace("steps=3", "steps=1, profile=1"))
    first = mnb.last_profile
    assert first is not None and first.folder.parent == cpu_pool.workdir() / "profiles"
    ahead = time.time() + 3600
    for path in [first.folder, *first.folder.rglob("*")]:
        os.utime(path, (ahead, ahead))
    shell.run_cell_magic("megatron", "", "mnb.train(model, steps=1, profile=1)")
    second = mnb.last_profile
    assert second is not None and second.folder != first.folder, (first.folder, second.folder)
    assert second.folder.name.startswith("cell-") and second.folder.parent == first.folder.parent
    assert [len(second.steps(r)) for r in (0, 1)] == [1, 1]
    capsys.readouterr()
    shell.run_cell_magic("megatron", "", "x = 1")
    out = capsys.readouterr().out
    assert mnb.last_profile is second and "profiled step" not in out and str(first.folder) not in out
    assert cpu_pool.last_cell_profile is None
