"""Memory by component, counted on real CPU ranks, against mnb.estimate.memory.

The ranks count their own tensors (mnb.megatron.memory.ComponentMeter): the
parameters' storages, DDP's (or Megatron-FSDP's) buffers, the optimizer's tensors, and what
autograd saves for backward while each microbatch's forward runs.  The
estimator must match: weights, gradients and optimizer exactly (the
distributed optimizer's buffers are padded to a bucket multiple), activations
within 10 %.
"""

from __future__ import annotations

import pytest

import mnb
from mnb.config import ParallelConfig

pytestmark = pytest.mark.slow

CASES = [
    ("tiny", ParallelConfig(), ""),
    ("tiny", ParallelConfig(tp=2), ""),
    ("tiny", ParallelConfig(tp=2, sequence_parallel=True), ""),
    ("tiny", ParallelConfig(pp=2), ""),
    ("tiny", ParallelConfig(pp=2, vpp=2), ""),
    ("tiny", ParallelConfig(), ", recompute='selective'"),
    ("tiny", ParallelConfig(tp=2, sequence_parallel=True), ", recompute='full'"),
    ("tiny", ParallelConfig(), ", use_distributed_optimizer=True"),
    ("tiny", ParallelConfig(cp=2), ""),  # mnb's cp attention: the whole sequence's K/V in every layer
    ("moe-tiny", ParallelConfig(ep=2), ""),
    ("moe-tiny", ParallelConfig(tp=2, sequence_parallel=True), ""),
]


@pytest.mark.parametrize("preset, layout, extra", CASES,
                         ids=[f"{p}-{lay.describe()}{x.split('=')[0].replace(', ', '-')}" for p, lay, x in CASES])
def test_measured_components_match_the_estimate(cpu_pool, preset, layout, extra):
    cpu_pool.run(f"model = mnb.gpt({preset!r}, num_layers=4)\n"
                 f"mnb.train(model, steps=2, micro_batch_size=2, global_batch_size=8{extra})",
                 layout=layout, quiet=True)
    run = mnb.last_run
    measured = run.measured_memory
    assert sorted(measured) == [0, 1]
    padded = "use_distributed_optimizer" in extra
    for rank, counted in measured.items():
        predicted = run.predicted_components(rank)
        for name in ("weights", "gradients", "optimizer"):
            if padded:
                assert counted[name] == pytest.approx(predicted[name], rel=0.01), (rank, name)
            else:
                assert counted[name] == predicted[name], (rank, name, counted, predicted)
        assert counted["activations"] == pytest.approx(predicted["activations"], rel=0.10), (rank, counted, predicted)
        assert counted["peak"] == sum(counted[n] for n in ("weights", "gradients", "optimizer", "activations"))
    cpu_pool.run("pass", layout=ParallelConfig())


def test_activations_follow_the_microbatches_in_flight(cpu_pool):
    """1F1B: stage 0 of pp=2 holds two microbatches' activations at once, stage 1 one."""
    cpu_pool.run("model = mnb.gpt('tiny')\nmnb.train(model, steps=1, micro_batch_size=2, global_batch_size=8)",
                 layout=ParallelConfig(pp=2), quiet=True)
    records = {r["rank"]: r["memory_components"] for r in mnb.last_run.records}
    for rank, expected_in_flight in ((0, 2), (1, 1)):
        per_microbatch = records[rank]["activations_per_microbatch"]
        assert records[rank]["activations"] == expected_in_flight * per_microbatch
    cpu_pool.run("pass", layout=ParallelConfig())


def test_memory_plot_shows_each_component_predicted_beside_measured(cpu_pool):
    import matplotlib

    matplotlib.use("Agg")
    cpu_pool.run("model = mnb.gpt('tiny')\nmnb.train(model, steps=1, micro_batch_size=2, global_batch_size=4)",
                 layout=ParallelConfig(tp=2), quiet=True)
    run = mnb.last_run
    ax = run.plot_memory()
    assert len(ax.patches) == 2 * 5 * 2  # 2 ranks x 5 components x (predicted, measured)
    assert ax.get_ylabel() == "memory per rank (MiB)"  # a toy model is drawn at its own scale
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights[0] > 0  # every bar visible, none dwarfed by process memory
    assert "counted tensors" in run.summary() and "activations" in run.summary()
    cpu_pool.run("pass", layout=ParallelConfig())


def test_progress_and_summary_give_the_same_throughput(cpu_pool):
    """The live line shows each step's tokens/s; the summary their mean over steps 2-N, and says so."""
    seen = []
    cpu_pool.event_handlers.append(lambda rank, kind, payload: seen.append((rank, payload)) if kind == "progress" else None)
    try:
        cpu_pool.run("model = mnb.gpt('tiny')\nmnb.train(model, steps=4, micro_batch_size=2, global_batch_size=8)",
                     layout=ParallelConfig(pp=2), quiet=True)
    finally:
        cpu_pool.event_handlers.pop()
    run = mnb.last_run
    reporter = {rank for rank, _ in seen}
    assert len(reporter) == 1 and len(seen) == 4
    rows = run.records_by_rank[reporter.pop()]["steps"]
    assert [p["tokens_per_s"] for _, p in seen] == [row["tokens_per_s"] for row in rows]
    mean = sum(run.tokens_per_s[1:]) / 3
    assert f"{mean:,.0f} tokens/s (mean of steps 2-4)" in run.summary()
    assert run.mfu[-1] is not None and 0 < run.mfu[-1] < 1  # against the ranks' measured GEMM peak
    cpu_pool.run("pass", layout=ParallelConfig())


# ----- ZeRO levels (Megatron-FSDP, --fsdp) ------------------------------------------------------
# The same tiny model on this pool under Megatron DDP, the distributed optimizer and Megatron-FSDP's
# three levels; FSDP's weight and gradient buffers are counted too.  Within 5 % (FSDP pads its buffers
# to bucket multiples) for every component.  ZeRO-3's weights are its shards plus the all-gather
# buckets held while the activations peak: Megatron-FSDP's prefetch budget (500M elements) holds every
# layer of tiny gathered at the start of backward (mnb.estimate.sharding.gathered_layers).
LEVELS = (None, "distributed optimizer", "optim_grads", "optim_grads_params")
"""``--fsdp optim`` is refused on CPU ranks (tests/megatron/test_fsdp.py): its ZeRO-1 is the distributed optimizer's."""
STATE = ("weights", "gradients", "optimizer")


def test_each_zero_level_matches_the_estimate_per_component(cpu_pool):
    counted, predicted = {}, {}
    for level in LEVELS:
        extra = ", use_distributed_optimizer=True" if level == "distributed optimizer" else ""
        layout = ParallelConfig(fsdp=None if level in (None, "distributed optimizer") else level)
        cpu_pool.run("model = mnb.gpt('tiny')\n"
                     f"mnb.train(model, steps=2, micro_batch_size=2, global_batch_size=8{extra})",
                     layout=layout, quiet=True)
        run = mnb.last_run
        assert run.layout.fsdp == layout.fsdp
        assert sorted(run.measured_memory) == [0, 1]
        counted[level] = run.measured_memory
        predicted[level] = {r: run.predicted_components(r) for r in (0, 1)}
    for level in LEVELS:
        for rank in (0, 1):
            got, want = counted[level][rank], predicted[level][rank]
            for name in STATE + ("activations",):
                assert got[name] == pytest.approx(want[name], rel=0.05), (level, rank, name, got, want)
    # what each level buys, measured: gradients halve from ZeRO-2 on, optimizer state from ZeRO-1 (the distributed optimizer) on
    ddp = counted[None][0]
    assert counted["optim_grads"][0]["gradients"] == pytest.approx(ddp["gradients"] / 2, rel=0.05)
    assert counted["distributed optimizer"][0]["optimizer"] == pytest.approx(ddp["optimizer"] / 2, rel=0.05)
    assert counted["optim_grads_params"][0]["gradients"] == pytest.approx(ddp["gradients"] / 2, rel=0.05)
