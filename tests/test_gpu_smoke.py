"""GPU smoke test: a 1-rank pool on CUDA trains ``mnb.gpt('tiny')`` and measures it (device machine only).

    python -m pytest -m gpu tests/test_gpu_smoke.py

Skipped by default (``-m 'not gpu'`` in pyproject.toml), and where nvidia-smi shows no GPU.
"""

from __future__ import annotations

import math

import pytest

from mnb.controller import Pool, last_run
from mnb.controller.machine import visible_gpu_count
from tests.conftest import assert_no_orphans

pytestmark = pytest.mark.gpu


def test_a_one_rank_cuda_pool_trains_tiny_and_measures_memory_and_mfu(tmp_path):
    if visible_gpu_count() < 1:
        pytest.skip("no GPU visible here (nvidia-smi found none)")
    pool = Pool.start(1, device="cuda", timeout=300, workdir=tmp_path)
    try:
        assert pool.run("(torch.cuda.is_available(), str(device))") == {0: (True, "cuda:0")}
        pool.run("model = mnb.gpt('tiny')\n"
                 "mnb.train(model, steps=3, micro_batch_size=2, global_batch_size=4)", quiet=True)
        run = last_run()
        assert run is not None and not run.on_cpu and len(run.steps) == 3
        assert all(loss is not None and math.isfinite(loss) for loss in run.losses), run.losses
        assert run.memory_source == "cuda" and run.peak_memory_bytes[0] > 0
        assert run.capacity_bytes and run.peak_memory_bytes[0] < run.capacity_bytes
        assert all(mfu is not None and 0 < mfu < 1 for mfu in run.mfu), run.mfu  # a datasheet peak: an H200
        pids = pool.pids()
    finally:
        pool.stop()
    assert_no_orphans(pids)
