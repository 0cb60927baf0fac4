"""Megatron training through a live pool: layouts change in place, old models are released."""

from __future__ import annotations

import pytest

import mnb
from mnb.config import ParallelConfig
from mnb.errors import CompositeRankError

pytestmark = pytest.mark.slow


def test_relayout_releases_old_model_and_destroys_its_groups(cpu_pool):
    cpu_pool.run("model = mnb.gpt('tiny')\nmnb.train(model, steps=2, micro_batch_size=2, global_batch_size=4)",
                 layout=ParallelConfig(tp=2))
    run = mnb.last_run
    assert run is not None and run.layout.tp == 2 and len(run.losses) == 2
    cpu_pool.run("import torch.distributed.distributed_c10d as c10d\ngroups_before = len(c10d._world.pg_map)")
    cpu_pool.run("pass", layout=ParallelConfig(pp=2))
    # The tp=2 model's memory is gone and using it says why.
    with pytest.raises(CompositeRankError, match="released because the layout changed from 'tp2 pp1 dp1' to 'tp1 pp2 dp1'"):
        cpu_pool.run("mnb.train(model, steps=1, micro_batch_size=2, global_batch_size=4)")
    assert cpu_pool.run("len(model.chunks)") == {0: 0, 1: 0}
    # Megatron forgets its groups on destroy_model_parallel; mnb destroys them, so
    # the number of live groups does not grow with every re-layout.
    counts = []
    for layout in (ParallelConfig(tp=2), ParallelConfig(pp=2), ParallelConfig(tp=2), ParallelConfig(pp=2)):
        cpu_pool.run("pass", layout=layout)
        counts.append(cpu_pool.run("len(c10d._world.pg_map)")[0])
    assert counts[2] == counts[0] and counts[3] == counts[1], counts
    cpu_pool.run("model = mnb.gpt('tiny')\nmnb.train(model, steps=2, micro_batch_size=2, global_batch_size=4)")
    assert mnb.last_run.layout.pp == 2
    cpu_pool.run("pass", layout=ParallelConfig())


def test_the_first_losses_do_not_depend_on_the_number_of_steps(cpu_pool, tmp_path):
    """steps=3 and steps=6 start on the same batches, also when 6 steps read past one epoch of the corpus."""
    corpus = tmp_path / "words"
    corpus.mkdir()
    for doc in range(6):  # six documents (Megatron shuffles them), about 70 samples of 64 tokens in all
        (corpus / f"{doc}.txt").write_text(" ".join(f"w{(i * (doc + 3)) % 89}" for i in range(220)))
    cpu_pool.run(
        "from mnb.megatron.data import dataset_for\n"
        f"corpus = {str(corpus)!r}\n"
        "models = [mnb.gpt('tiny', vocab_size=257, seed=3) for _ in range(2)]\n"
        "epoch = len(dataset_for(corpus, models[0].config, models[0].config.seq_length, 1, 1234))\n"
        "runs = [mnb.train(m, steps=n, data=corpus, micro_batch_size=4, global_batch_size=16)\n"
        "        for m, n in zip(models, (3, 6))]", quiet=True)
    epoch = cpu_pool.pull("epoch")[0]
    assert 3 * 16 <= epoch < 6 * 16  # the longer run crosses an epoch: Megatron would reshuffle from sample 0
    three, six = cpu_pool.run("[r['losses'] for r in runs]")[0]
    assert len(three) == 3 and len(six) == 6
    assert six[:3] == pytest.approx(three, rel=1e-6, abs=0)


def test_measured_bubble_is_a_fraction_of_a_1f1b_schedule(cpu_pool):
    """pp=2 on CPU ranks: 1F1B order per stage; the bubble is in [0, 1] on every stage.

    Two equal stages (one decoder layer each, small vocabulary) so compute, not the
    embedding or the output layer, decides each stage's time.  How close the measured
    value comes to (p-1)/(m+p-1), and that it falls with m, depends on the machine's
    load: that is a benchmark (BENCHMARKS.md, bench/), not a test.
    """
    cpu_pool.run("model = mnb.gpt('tiny', num_layers=2, hidden_size=256, ffn_hidden_size=1024, seq_length=128)",
                 layout=ParallelConfig(pp=2), quiet=True)
    measured = {}
    for m in (4, 8, 16):
        cpu_pool.run(f"mnb.train(model, steps=6, micro_batch_size=2, global_batch_size={2 * m})", quiet=True)
        run = mnb.last_run
        assert run.num_microbatches == m and run.theoretical_bubble == pytest.approx(1 / (m + 1))
        for value in [*run.measured_bubble_per_step.values(), *run.measured_bubble_by_stage.values()]:
            assert 0.0 <= value <= 1.0, run.measured_bubble_per_step
        assert set(run.measured_bubble_by_stage) == {0, 1}
        measured[m] = run.measured_bubble
    for stage in (0, 1):  # the last run (m = 16): Megatron's 1F1B order on each stage
        compute = [e for e in sorted(run.timeline(), key=lambda e: e["start_s"])
                   if e["stage"] == stage and e["kind"] in ("forward", "backward")]
        order = [(e["kind"][0], e["microbatch"]) for e in compute]
        warmup = 1 - stage  # 1F1B: p - r - 1 forwards before the first backward
        expected = [("f", i) for i in range(warmup + 1)]
        for i in range(16):
            expected.append(("b", i))
            if warmup + 1 + i < 16:
                expected.append(("f", warmup + 1 + i))
        assert order == expected, (stage, order)
    assert all(0.0 <= value <= 1.0 for value in measured.values()), measured
    cpu_pool.run("model = mnb.gpt('tiny', num_layers=4)\n"
                 "mnb.train(model, steps=4, micro_batch_size=1, global_batch_size=4)",
                 layout=ParallelConfig(pp=2, vpp=2), quiet=True)
    interleaved = mnb.last_run
    assert interleaved.theoretical_bubble == pytest.approx(1 / (2 * 4 + 1))
    assert all(0.0 <= v <= 1.0 for v in [*interleaved.measured_bubble_per_step.values(),
                                          *interleaved.measured_bubble_by_stage.values()])
    cpu_pool.run("pass", layout=ParallelConfig())


def test_moe_dispatch_and_combine_are_on_the_timeline(cpu_pool):
    cpu_pool.run("model = mnb.gpt('moe-tiny')\nmnb.train(model, steps=2, micro_batch_size=2, global_batch_size=8)",
                 layout=ParallelConfig(ep=2), quiet=True)
    run = mnb.last_run
    kinds = [e["kind"] for e in run.timeline(1)]
    layers, microbatches = run.model.num_layers, run.num_microbatches
    assert kinds.count("moe-dispatch") == kinds.count("moe-combine") == layers * microbatches
    # The timing wrappers are gone after train(): the dispatcher's own methods run again.
    assert cpu_pool.run("'token_dispatch' in vars(model.chunks[0].decoder.layers[0].mlp.token_dispatcher)") \
        == {0: False, 1: False}
    cpu_pool.run("pass", layout=ParallelConfig())
