"""mnb.profiles without ranks: a profile folder as mnb.megatron.profile writes it, read by Profile.

The traces here are small Kineto-shaped files (what torch.profiler exports on a CPU rank under gloo:
the main thread's ops and mnb's step span, gloo's ``pt_gloo_runloop`` thread that holds events only
outside the profiled step); tests/megatron/test_profile.py profiles real trainings.
"""

from __future__ import annotations

import json

from IPython.core.interactiveshell import InteractiveShell

from mnb.notebook.profiles import Profile

MAIN, GLOO = 101, 202


def _write_profile(folder, ranks=(0, 1)):
    for rank in ranks:
        events = [
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": MAIN, "args": {"name": "python main"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": GLOO, "args": {"name": "pt_gloo_runloop"}},
            # gloo's thread: one op before the step (set-up), none inside it
            {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 7, "tid": GLOO, "ts": 10.0, "dur": 5.0},
            {"ph": "X", "cat": "user_annotation", "name": "mnb.step 2", "pid": 7, "tid": MAIN, "ts": 100.0,
             "dur": 1000.0},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 7, "tid": MAIN, "ts": 110.0, "dur": 400.0},
            {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 7, "tid": MAIN, "ts": 520.0, "dur": 100.0},
            {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 7, "tid": MAIN, "ts": 700.0,
             "dur": 200.0},
        ]
        (folder / "trace").mkdir(parents=True, exist_ok=True)
        (folder / "meta").mkdir(exist_ok=True)
        (folder / "trace" / f"rank-{rank}.trace.json").write_text(json.dumps(
            {"traceEvents": events, "baseTimeNanoseconds": 1_000_000_000, "distributedInfo": {"rank": rank}}))
        (folder / "meta" / f"rank-{rank}.json").write_text(json.dumps(
            {"rank": rank, "step_costs": [{"step": 2, "start_s": 1.0, "seconds": 0.002}], "comms": []}))
    return Profile(folder)


def test_profile_summary_shows_as_text_through_ipythons_formatter(tmp_path):
    prof = _write_profile(tmp_path / "p")
    text = prof.summary()
    assert "\n" in text and "rank 1: compute" in text and "aten::mm" in text
    formatter = InteractiveShell.instance().display_formatter
    shown, _ = formatter.format(text)  # what Jupyter shows for a cell ending in prof.summary()
    assert shown["text/plain"] == str(text) and "\\n" not in shown["text/plain"]
    assert formatter.format(prof)[0]["text/plain"] == str(text)  # mnb.last_profile itself too


def test_profile_plot_has_a_row_only_for_threads_with_events_in_its_range(tmp_path):
    prof = _write_profile(tmp_path / "p")
    fig = prof.plot()  # the first profiled step: gloo's thread has nothing there
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["rank 0 · python main", "rank 1 · python main"], labels
    every = prof.plot(range=(0.0, 2.0))  # from 0 ms: gloo's op is inside
    labels = [t.get_text() for t in every.axes[0].get_yticklabels()]
    assert labels == ["rank 0 · python main", "rank 0 · pt_gloo_runloop",
                      "rank 1 · python main", "rank 1 · pt_gloo_runloop"], labels


def test_estimate_and_explorer_texts_show_as_text():
    """Every text a cell may end with: the step-time table and the explorer's summary (the run's, the memory
    estimate's and the plan's are in tests/test_runs.py)."""
    from mnb import estimate
    from mnb.widgets import explorer

    formatter = InteractiveShell.instance().display_formatter
    for text in (estimate.step_time("tiny", {"tp": 1}, gpus=1, gpu="h200").explain().table(),
                 explorer(model="tiny", gpus=2, gpu="h200").summary()):
        assert "\n" in text
        assert formatter.format(text)[0]["text/plain"] == str(text), text
    # the estimates themselves as a cell's value: their text, not a dataclass dump
    memory = estimate.memory("tiny", {"tp": 1})
    assert formatter.format(memory)[0]["text/plain"] == str(memory.summary())
    time = estimate.step_time("tiny", {"tp": 1}, gpus=1, gpu="h200")
    assert formatter.format(time)[0]["text/plain"] == str(time.explain().table())


def test_an_op_wrapping_a_collective_is_the_collectives_time_despite_the_clocks_few_microseconds(tmp_path):
    """mnb's collective spans sit on the profiler's clock by an estimated offset: an autograd op that wraps a
    synchronous all-reduce can appear to start just after it.  It is the collective's time, not compute that
    overlaps it (the overlap read 38-77 % in some tp2 profiles); compute after the collective still counts."""
    from mnb.notebook import profiles

    profile = _write_profile(tmp_path, ranks=(0,))
    for shift in (-1.0, 0.0, 1.0, profiles.ALIGNMENT_SLACK_US - 1):  # the wrapper starts this long after the span
        profile.events = [e for e in profile.events if e.get("pid") != 0 or e.get("ph") != "X"] + [
            {"pid": 0, "ph": "X", "cat": "user_annotation", "name": "mnb.step 2", "ts": 0.0, "dur": 2000.0},
            {"pid": 0, "ph": "X", "cat": "comm", "tid": profiles.COMM_TID, "name": "mnb.comm all_reduce tp",
             "ts": 100.0, "dur": 1000.0, "args": {"op": "all_reduce", "group": "tp", "bytes": 4}},
            {"pid": 0, "ph": "X", "cat": "cpu_op", "name": "_ReduceFromModelParallelRegion", "ts": 100.0 + shift,
             "dur": 1000.0},
            {"pid": 0, "ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1200.0, "dur": 300.0}]
        shares = profile._shares(0)
        assert shares["overlap"] == 0.0, (shift, shares)
        assert shares["communication"] == 0.5 and shares["compute"] == 0.15, (shift, shares)
