"""GPU smoke tests: a 1-rank pool on CUDA trains ``mnb.gpt('tiny')`` (its norms, SwiGLUs, RoPE and loss in mnb's Triton kernels) and
measures it, and the GPU-only fast paths fail over when refused (device machine only).

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
        # tiny's 9 RMSNorms, 4 SwiGLUs, 8 RoPEs (query and key of 4 layers) and 1 loss a micro batch, 2 micro
        # batches, 3 steps, through mnb's kernels each way (and their probes); nothing compiled by Inductor
        calls = pool.run("from mnb.megatron import background_compile, fusions, loss_kernels, norm_kernels, "
                         "rope_kernels, swiglu_kernels\n"
                         "[dict(k.calls) for k in (norm_kernels, swiglu_kernels, rope_kernels, loss_kernels)], "
                         "dict(fusions.calls), background_compile.pending() is None")[0]
        for (name, per_micro_batch), counted in zip((("norm", 9), ("swiglu", 4), ("rope", 8), ("loss", 1)), calls[0]):
            assert counted["forward"] == counted["backward"] >= per_micro_batch * 2 * 3, (name, counted)
        assert calls[1] == {"compiled": 0, "eager": 0} and calls[2] is True, calls
        pids = pool.pids()
    finally:
        pool.stop()
    assert_no_orphans(pids)


def test_refused_fast_paths_train_with_ddps_add_and_decode_uncompiled_with_the_same_results(tmp_path):
    """The GPU-only fast paths fail over, never fail the cell: a torch whose ``addmm(out_dtype=...)`` fails
    wgrad_fusion's probe trains with DDP's add (nothing counted in the fused kernel), and a compiled decode
    step that does not capture (twice: the first failure is tried again as it is) is captured uncompiled,
    with the plain path's tokens, and says so."""
    if visible_gpu_count() < 1:
        pytest.skip("no GPU visible here (nvidia-smi found none)")
    pool = Pool.start(1, device="cuda", timeout=300, workdir=tmp_path)
    train = "model = mnb.gpt('tiny')\nmnb.train(model, steps=2, micro_batch_size=2, global_batch_size=4, bf16=True)\n"
    try:
        refused = pool.run(
            "from mnb.megatron import decode_graphs, wgrad_fusion\n"
            "kept = wgrad_fusion._add_product\n"
            "def refuse(*args):\n    raise RuntimeError('addmm with out_dtype refused (test)')\n"
            "wgrad_fusion._add_product, wgrad_fusion._probed = refuse, {}\n"
            "wgrad_fusion.calls.update(fp32=0, same_dtype=0)\n"
            "try:\n" + "".join("    " + line + "\n" for line in train.splitlines()) +
            "finally:\n    wgrad_fusion._add_product, probed, wgrad_fusion._probed = kept, dict(wgrad_fusion._probed), {}\n"
            "(probed, dict(wgrad_fusion.calls))", quiet=True)
        assert refused[0] == ({"cuda:0": False}, {"fp32": 0, "same_dtype": 0}), refused
        unfused = last_run().losses
        fused = pool.run(train + "(dict(wgrad_fusion._probed), wgrad_fusion.calls['fp32'])", quiet=True)
        assert fused[0][0] == {"cuda:0": True} and fused[0][1] > 0, fused
        assert last_run().losses[0] == pytest.approx(unfused[0], rel=1e-3), (last_run().losses, unfused)

        decoded = pool.run(
            "prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]\n"
            "plain = mnb.generate(model, prompts, max_new_tokens=12, stream=False)\n"
            "Real, refusals = decode_graphs.Graph, []\n"
            "class RefusedOnce(Real):\n"
            "    def __init__(self, step):\n"
            "        if len(refusals) < 2:\n"
            "            refusals.append(1)\n"
            "            raise RuntimeError('capture refused (test)')\n"
            "        super().__init__(step)\n"
            "decode_graphs.Graph = RefusedOnce\n"
            "try:\n    compiled = mnb.generate(model, prompts, max_new_tokens=12, stream=False, compile=True)\n"
            "finally:\n    decode_graphs.Graph = Real\n"
            "(plain, compiled, repr(model.decoder.compile_failed), model.decoder.capture_notes,\n"
            " sorted((key, graph.captured) for entry in model.decoder.entries.values()\n"
            "        for key, graph in entry.graphs.items()))", quiet=True)
        plain, compiled, failed, notes, graphs = decoded[0]
        assert compiled == plain and len(plain) == 2 and all(plain), decoded
        assert "capture refused (test)" in failed, failed
        assert notes == ["the decode step did not capture with compiled layers (rank 0: RuntimeError: capture "
                         "refused (test)); captured it without"], notes
        assert graphs == [((0, True, False), True), ((0, True, True), True)], graphs  # both captured
        pids = pool.pids()
    finally:
        pool.stop()
    assert_no_orphans(pids)
