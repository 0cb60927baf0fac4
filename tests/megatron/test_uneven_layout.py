"""Uneven end stages under interleaving, as Megatron-Core builds them from its
``pipeline_model_parallel_layout`` (issue 41): the chunks the ranks build are the ones the
estimators count, and the model trains as on one stage."""

from __future__ import annotations

import pytest

from mnb.config import ParallelConfig, model_config, uneven_pipeline_layout

pytestmark = pytest.mark.slow


def test_uneven_end_stages_interleaved_build_the_estimators_chunks_and_train_as_one_stage(cpu_pool):
    layout = uneven_pipeline_layout(6, 2, 2, first=3)  # 3 layers on the first rank, as 1 + 2 over its chunks
    assert layout == "Et|,(tt|)*2,tL"
    counts = model_config("tiny", num_layers=6, pipeline_model_parallel_layout=layout).layers_per_virtual_stage(2, 2)
    assert counts == [[1, 2], [2, 1]]
    train = "r = mnb.train(model, steps=3, micro_batch_size=1, global_batch_size=4)\n"
    built = cpu_pool.run(f"model = mnb.gpt('tiny', num_layers=6, pipeline_model_parallel_layout={layout!r})\n"
                         + train + "([len(c.decoder.layers) for c in model.chunks], r['losses'])",
                         layout=ParallelConfig(pp=2, vpp=2), quiet=True)
    assert [built[rank][0] for rank in (0, 1)] == counts
    one = cpu_pool.run("model = mnb.gpt('tiny', num_layers=6)\n" + train + "r['losses']",
                       layout=ParallelConfig(), quiet=True)[0]
    losses = built[1][1] or built[0][1]  # the last stage holds the loss
    assert len(losses) == 3 and losses == pytest.approx(one, rel=1e-4)
    cpu_pool.run("pass", layout=ParallelConfig())
