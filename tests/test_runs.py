"""mnb.runs.Run on synthetic per-rank records (also used by tests/plot/).

A pp=2, m=4 1F1B step written out by hand (forward 1 s, backward 2 s):

    stage 0: F0 [0,1] F1 [1,2] .. B0 [4,6] F2 [6,7] B1 [7,9] F3 [9,10] B2 [10,12] . B3 [13,15]
    stage 1: .  F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] F2 [7,8] B2 [8,10] F3 [10,11] B3 [11,13] ..

Span 15 s, busy 12 s per stage, idle 3 s per stage: bubble 3/15 = 0.2 = (p-1)/(m+p-1).
Step 2 is the same but stage 0's last backward takes 3 s: span 16, idle 3 (stage 0)
and 4 (stage 1): bubble (3/16 + 4/16) / 2 = 0.21875.
"""

from __future__ import annotations

import copy
import json

import pytest

from mnb.config import ParallelConfig, load_preset
from mnb.estimate import MemoryEstimate
from mnb.analysis.runs import Run

STAGE0 = [("forward", 0, 0, 1), ("forward", 1, 1, 2), ("backward", 0, 4, 6), ("forward", 2, 6, 7),
          ("backward", 1, 7, 9), ("forward", 3, 9, 10), ("backward", 2, 10, 12), ("backward", 3, 13, 15)]
STAGE1 = [("forward", 0, 1, 2), ("backward", 0, 2, 4), ("forward", 1, 4, 5), ("backward", 1, 5, 7),
          ("forward", 2, 7, 8), ("backward", 2, 8, 10), ("forward", 3, 10, 11), ("backward", 3, 11, 13)]


def _events(step: int, stage: int, ops, t0: float, stretch_last: float = 0.0):
    out = []
    for i, (kind, mb, s, e) in enumerate(ops):
        if i == len(ops) - 1:
            e += stretch_last
        out.append({"step": step, "stage": stage, "chunk": 0, "kind": kind, "microbatch": mb,
                    "start_s": t0 + s, "end_s": t0 + e})
    if stage == 1:
        out.append({"step": step, "stage": 1, "chunk": 0, "kind": "forward-recv", "microbatch": 0,
                    "start_s": t0 + 0.0, "end_s": t0 + 1.0})
    end = max(ev["end_s"] for ev in out)
    out.append({"step": step, "stage": stage, "chunk": None, "kind": "all-grads-sync", "microbatch": None,
                "start_s": end, "end_s": end + 0.5})
    out.append({"step": step, "stage": stage, "chunk": None, "kind": "optimizer", "microbatch": None,
                "start_s": end + 0.5, "end_s": end + 1.0})
    return out


def make_records(device: str = "cuda:0", device_name: str = "NVIDIA H200") -> list[dict]:
    model = load_preset("tiny").to_dict()
    train = {"steps": 2, "micro_batch_size": 1, "global_batch_size": 4, "bf16": True}
    records = []
    for rank in (0, 1):
        timeline = _events(1, rank, STAGE0 if rank == 0 else STAGE1, 100.0)
        timeline += _events(2, rank, STAGE0 if rank == 0 else STAGE1, 200.0, 1.0 if rank == 0 else 0.0)
        steps = []
        for step, loss, t in ((1, 5.5, 17.0), (2, 5.0, 18.0)):
            steps.append({"step": step, "loss": loss if rank == 1 else None, "grad_norm": 1.0, "lr": 3e-4,
                          "step_time_s": t - 0.5 * rank, "tokens_per_s": 4 * 64 / t,
                          "mem_allocated_bytes": 1000, "mem_peak_bytes": 2_000_000 + rank,
                          "mem_reserved_bytes": 3_000_000})
        records.append({
            "rank": rank, "world_size": 2,
            "coords": {"tp": 0, "pp": rank, "dp": 0, "cp": 0, "ep": 0},
            "layout": {"tp": 1, "pp": 2, "vpp": None, "cp": 1, "ep": 1, "dp": 1, "sequence_parallel": False},
            "model": copy.deepcopy(model), "train": dict(train),
            "device": device, "device_name": device_name,
            "num_microbatches": 4, "num_parameters_local": 50_000,
            "model_flops_per_step": 1e12, "memory_source": "cuda" if device != "cpu" else "rss",
            "steps": steps, "timeline": timeline,
            "memory": {"peak_allocated_bytes": 2_000_000 + rank, "peak_reserved_bytes": 3_000_000,
                       "capacity_bytes": None if device == "cpu" else 150_000_000_000},
        })
    return records


def test_losses_times_and_layout():
    run = Run(make_records())
    assert run.steps == [1, 2]
    assert run.losses == [5.5, 5.0]  # only the last stage reports a loss
    assert run.step_times_s == [17.0, 18.0]  # slowest rank
    assert run.tokens_per_s == pytest.approx([256 / 17, 256 / 18])  # as recorded (min over ranks)
    assert run.layout == ParallelConfig(tp=1, pp=2, dp=1)
    assert run.model.name == "tiny" and run.train.global_batch_size == 4
    assert sorted(run.records_by_rank) == [0, 1] and run.ranks == run.records_by_rank
    assert run.peak_memory_bytes == {0: 2_000_000, 1: 2_000_001}


def test_measured_bubble_from_timeline():
    run = Run(make_records())
    assert run.measured_bubble_per_step == pytest.approx({1: 0.2, 2: 0.21875})
    assert run.measured_bubble == pytest.approx(0.21875)  # median of the steps after the first
    assert run.measured_bubble_by_stage == pytest.approx({0: 3 / 16, 1: 4 / 16})
    assert run.theoretical_bubble == pytest.approx(0.2)
    events = run.timeline(1)
    assert {e["stage"] for e in events} == {0, 1}
    assert all(e["step"] == 1 for e in events)


def test_mfu_uses_device_peak():
    run = Run(make_records())
    assert run.mfu == pytest.approx([1e12 / (17.0 * 2 * 989e12), 1e12 / (18.0 * 2 * 989e12)])
    cpu = Run(make_records(device="cpu", device_name="cpu"))
    assert cpu.mfu == [None, None]
    assert "MFU n/a" in cpu.summary()
    assert "ranks on CPU" in cpu.summary() and "not compared with the prediction" in cpu.summary()
    measured = make_records(device="cpu", device_name="cpu")
    for record, flops in zip(measured, (40e9, 50e9)):
        record.update(peak_flops=flops, peak_source="measured CPU GEMM peak (float32)")
    cpu_measured = Run(measured)
    assert cpu_measured.peak_flops_per_device == 40e9  # the slower rank's
    assert cpu_measured.mfu == pytest.approx([1e12 / (17.0 * 2 * 40e9), 1e12 / (18.0 * 2 * 40e9)])
    assert "vs measured CPU GEMM peak (float32) 40 GFLOP/s" in cpu_measured.summary()
    assert "tokens/s (step 2)" in cpu_measured.summary()  # the figure says which steps it averages
    given = Run(make_records(device="cpu", device_name="cpu"), peak_flops=1e12)
    assert given.mfu == pytest.approx([1 / 34, 1 / 36])
    assert Run(make_records(device="cpu", device_name="cpu"), gpu="cpu").mfu[0] > 0


def test_predicted_memory_and_summary():
    run = Run(make_records())
    pred = run.predicted_memory
    assert isinstance(pred, MemoryEstimate) and len(pred.stages) == 2
    assert pred.capacity_bytes == 150_000_000_000
    text = run.summary()
    for piece in ("tiny", "tp1 pp2 dp1", "loss 5.5000 -> 5.0000", "MFU", "bubble measured 21.9% (step 2) vs theoretical 20.0%",
                  "peak memory", "vs predicted"):
        assert piece in text, (piece, text)
    assert "<b>mnb run</b>" in run._repr_html_()
    assert repr(run).startswith("<Run tiny")


def test_predicted_memory_follows_the_ranks_fusions():
    records = make_records()
    plain = Run(records).predicted_memory.stages[1].logits_bytes
    for rec in records:
        rec["fusions"] = True
    run = Run(records)
    assert run.fusions is True and Run(make_records()).fusions is False
    assert run.predicted_memory.stages[1].logits_bytes == pytest.approx(plain * 4 / 6)  # 2 x bf16 vs 4 + 2


def test_json_round_trip():
    run = Run(make_records(), peak_flops=5e14)
    back = Run.from_dict(json.loads(json.dumps(run.to_dict())))
    assert back.losses == run.losses
    assert back.mfu == run.mfu
    assert back.measured_bubble == pytest.approx(run.measured_bubble)
    assert back.to_dict() == run.to_dict()


def test_tolerates_missing_optional_keys():
    recs = make_records()
    for r in recs:
        for key in ("timeline", "memory", "model_flops_per_step", "num_microbatches", "coords"):
            r.pop(key)
    run = Run(recs)
    assert run.measured_bubble is None
    assert run.peak_memory_bytes == {0: 2_000_000, 1: 2_000_001}  # from the per-step peaks
    assert run.num_microbatches == 4
    assert run.mfu[0] > 0  # FLOPs from mnb.estimate
    assert "loss" in run.summary()
    with pytest.raises(ValueError, match="at least one rank record"):
        Run([])


def test_expected_bubble_replays_measured_stage_times():
    from mnb.estimate import simulate_schedule

    records = make_records()
    layout = ParallelConfig(pp=2).resolve(2)
    for step in (1, 2):  # a timeline whose stage 1 is 1.5x slower than stage 0
        events = simulate_schedule(layout, 4, forward_s=[1.0, 1.5], backward_s=[2.0, 3.0], step=step)
        for rank, record in enumerate(records):
            record["timeline"] = [e for e in record["timeline"] if e["step"] != step] + [
                e for e in events if e["stage"] == rank]
    run = Run(records)
    assert run.theoretical_bubble == pytest.approx(0.2)
    assert run.measured_bubble > 0.25  # the faster stage waits for the slower one
    assert run.expected_bubble == pytest.approx(run.measured_bubble)
    assert "for the measured stage times" in run.summary()


def test_summaries_render_as_text():
    """A summary as a cell's last value shows its lines, not a quoted string with \\n (IPython's pretty printer too)."""
    from IPython.lib.pretty import pretty

    from mnb import estimate

    run = Run(make_records())
    for text in (run.summary(), estimate.memory("tiny", {"tp": 1}).summary(),
                 estimate.plan("tiny", gpus=2, gpu="h200").table()):
        assert isinstance(text, str) and "\n" in text
        assert repr(text) == str(text) == pretty(text) and "\\n" not in repr(text)
        assert text.splitlines() == str(text).splitlines() and text == str(text)
    assert run.lrs == [3e-4, 3e-4]


def test_train_result_is_the_record_with_a_one_line_repr():
    import json
    import pickle

    from IPython.lib.pretty import pretty

    from mnb.results import LoadResult, TrainResult
    from mnb.values import kernel_safe, loads_safe

    record = make_records()[1]
    record["memory_components"] = {"peak": 3 * 2**20}
    result = TrainResult(record)
    line = repr(result)
    assert "\n" not in line and len(line) < 160 and pretty(result) == line
    for piece in ("rank 1 (tp0 pp1 dp0)", "2 steps (1-2)", "loss 5.5000 -> 5.0000", "14 tokens/s", "peak 3.0 MiB"):
        assert piece in line, (piece, line)
    assert result == record and json.loads(json.dumps(result)) == json.loads(json.dumps(record))
    assert result["losses"] == [5.5, 5.0] == result.losses and result.lrs == [3e-4, 3e-4]
    assert "losses" not in result and set(result) == set(record)  # derived, not stored
    travelled = loads_safe(pickle.dumps(kernel_safe(result), protocol=5))  # as a pulled value reaches the kernel
    assert type(travelled) is TrainResult and travelled == record
    info = LoadResult({"path": "/c/run1", "step": 20, "layout": {"tp": 2, "pp": 1, "vpp": 1, "dp": 1},
                       "optimizer_loaded": True, "schedule_loaded": True, "rng_loaded": False})
    assert repr(info) == "<mnb.load /c/run1: step 20, saved under tp2 pp1 dp1; weights, optimizer, schedule loaded>"


def _four_steps(profiled: tuple[int, ...], rank_profiled: int = 1) -> list[dict]:
    """make_records with steps 1-4 (4 is as fast as 2), ``profiled`` steps 3x slower, marked on one rank."""
    records = make_records(device="cpu", device_name="cpu")
    for record in records:
        rows = []
        for step, t in ((1, 17.0), (2, 10.0), (3, 10.0), (4, 12.0)):
            t *= 3 if step in profiled else 1
            row = {"step": step, "loss": 5.0, "step_time_s": t, "tokens_per_s": 256 / t}
            if step in profiled and record["rank"] == rank_profiled:
                row["profiled"] = True  # what mnb.train records for a step the profiler ran through
            rows.append(row)
        record["steps"] = rows
    return records


def test_summary_means_leave_profiled_steps_out_and_say_which_steps_they_cover():
    run = Run(_four_steps(profiled=(3,)))
    assert run.profiled_steps == [3]  # one rank profiled it: the step was slow for all
    text = run.summary()
    mean = (256 / 10 + 256 / 12) / 2  # steps 2 and 4; not 3 (profiled), not 1 (warm-up)
    assert f"{mean:,.0f} tokens/s (mean of steps 2, 4; profiled step 3 left out)" in text, text
    every = Run(_four_steps(profiled=(2, 3, 4)))  # nothing unprofiled after the warm-up: in, and said so
    assert every.profiled_steps == [2, 3, 4]
    assert "tokens/s (mean of steps 2-4, all profiled (slowed by the profiler))" in every.summary()
    plain = Run(_four_steps(profiled=()))
    assert plain.profiled_steps == [] and "tokens/s (mean of steps 2-4)," in plain.summary()


def test_summary_says_which_steps_ran_unfused_at_what_memory_and_which_waited():
    """The rows mnb.train writes for a fused model (``compiling``, ``waited_for_kernels_s``; the allocator's
    peak of each step) become the summary's line about the first steps (issue 39)."""
    gib = 2**30
    records = make_records()
    for record in records:
        rows = []
        for step, compiling, peak, waited in ((1, True, 80, None), (2, True, 111, None), (3, False, 110, 4.0),
                                              (4, False, 110, None)):
            row = {"step": step, "loss": 5.0, "step_time_s": 2.0, "tokens_per_s": 128.0, "compiling": compiling,
                   "mem_peak_bytes": peak * gib + record["rank"]}
            if waited is not None:
                row["waited_for_kernels_s"] = waited + record["rank"]
            rows.append(row)
        record["steps"], record["fusions"] = rows, True
    run = Run(records)
    assert run.unfused_steps == [1, 2]
    assert run.step_peak_bytes([1, 2]) == 111 * gib + 1  # the most of any rank in those steps
    assert run.kernel_waits == {3: 5.0}  # the longest wait of any rank
    text = str(run.summary())
    assert "steps 1\u20132 unfused while compiling, peak 111.00 GiB (fused steps 110.00 GiB)" in text, text
    assert "step 3 waited 5.0 s for the fused kernels (unfused it would not have fit)" in text, text
    cpu = make_records(device="cpu", device_name="cpu")  # a CPU rank's per-step reading is the resident set
    for record in cpu:
        record["steps"] = [dict(row, compiling=True) for row in record["steps"]]
    assert Run(cpu).step_peak_bytes([1, 2]) is None
    assert "steps 1\u20132 unfused while compiling (the fused kernels were not ready yet)\n" in str(Run(cpu).summary())
