"""mnb.megatron.data / tokenizer: corpora to Megatron .bin/.idx to GPTDataset items.

    python -m pytest tests/megatron/test_data.py -q
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import numpy as np
import pytest
import torch

from mnb.config import model_config
from mnb.megatron import data
from mnb.megatron.tokenizer import EOD_ID, ByteTokenizer, MockTokenizer


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MNB_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "texts"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("hello world\n")
    (root / "sub" / "b.md").write_text("naïve café ✓\n\nsecond paragraph\n")
    (root / ".hidden").write_text("never read")
    (root / "blob.bin").write_bytes(b"\0\1\2binary")
    return root


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'naïve ✓ 日本'\n"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert max(ids) < 256 and tok.vocab_size == 257 and tok.eod == EOD_ID == 256
    assert tok.detokenize(ids + [tok.eod]) == text
    assert tok.pad == -1  # Megatron's "no pad token": padded positions are loss-masked
    offsets = tok.offsets(tok.tokenize("aé"), "aé")
    assert offsets == [0, 1, 1]
    json.dumps(dict(tok.unique_identifiers))  # Megatron hashes it as JSON
    mock = MockTokenizer(256)
    assert (mock.vocab_size, mock.eod) == (256, 255)


def test_build_and_read_back_exact_ids(corpus, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    files = data.resolve_text_files(corpus)
    assert [f.relative_to(corpus).as_posix() for f in files] == ["a.txt", "sub/b.md"]
    prefix = data.build_indexed_dataset(files, str(tmp_path / "out" / "corpus"))
    ds = IndexedDataset(prefix)
    assert len(ds) == 2
    for i, f in enumerate(files):
        expected = list(f.read_bytes()) + [EOD_ID]
        assert ds[i].tolist() == expected
    assert ds.index.dtype == np.uint16
    meta = data.read_meta(prefix)
    assert meta["num_documents"] == 2 and meta["max_token_id"] == EOD_ID
    assert not list((tmp_path / "out").glob("*.tmp-*"))  # no temporary leftovers


def test_cache_hit_reuses_the_built_files(corpus, tmp_path):
    files = data.resolve_text_files(corpus)
    prefix = data.build_indexed_dataset(files, str(tmp_path / "c"))
    stamp = os.stat(prefix + ".bin").st_mtime_ns
    assert data.build_indexed_dataset(files, str(tmp_path / "c")) == prefix
    assert os.stat(prefix + ".bin").st_mtime_ns == stamp  # not rewritten (how fast: a benchmark)
    (corpus / "a.txt").write_text("changed\n")  # new content -> rebuilt
    data.build_indexed_dataset(files, str(tmp_path / "c"))
    assert os.stat(prefix + ".bin").st_mtime_ns != stamp


def test_a_bin_idx_pair_mnb_did_not_build_is_kept_unless_overwrite(corpus, tmp_path):
    """The corpus cache never writes over a .bin/.idx it did not build (a user's Megatron preprocess output);
    one it was building when it stopped (its sidecar says so) is rebuilt without the flag."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from mnb.errors import OverwriteRefusedError

    files = data.resolve_text_files(corpus)
    prefix = str(tmp_path / "theirs")
    for suffix in (".bin", ".idx"):
        (tmp_path / ("theirs" + suffix)).write_bytes(b"user data" + suffix.encode())
    with pytest.raises(OverwriteRefusedError) as info:
        data.build_indexed_dataset(files, prefix)
    assert f"the corpus cache: {prefix}.bin, {prefix}.idx exist and mnb did not build them (no theirs.mnb.json" \
        in str(info.value) and "overwrite=True" in str(info.value), str(info.value)
    assert (tmp_path / "theirs.bin").read_bytes() == b"user data.bin"  # untouched
    assert data.build_indexed_dataset(files, prefix, overwrite=True) == prefix
    assert len(IndexedDataset(prefix)) == 2
    data._meta_path(prefix).write_text(json.dumps({"building": True}))  # as a build that stopped leaves it
    assert data.build_indexed_dataset(files, prefix) == prefix and data.read_meta(prefix)["num_documents"] == 2


def _build_in_child(files, prefix, queue):
    queue.put(data.build_indexed_dataset(files, prefix))


def test_concurrent_builders_agree(corpus, tmp_path):
    files = data.resolve_text_files(corpus)
    prefix = str(tmp_path / "shared" / "c")
    ctx = mp.get_context("fork")  # the parent has imported Megatron already
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(files, prefix, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results == [prefix] * 3
    assert data.read_meta(prefix)["num_documents"] == 2


def test_large_file_split_into_documents():
    paragraph = b"x" * 100 + b"\n\n"
    pieces = data._split_document(paragraph * 50, max_bytes=1000)
    assert b"".join(pieces) == paragraph * 50
    assert all(len(p) <= 1000 for p in pieces) and len(pieces) > 1
    assert all(p.endswith(b"\n\n") for p in pieces[:-1])


def test_stdlib_corpus_and_dataset_items():
    prefix = data.prepare("stdlib-small")
    meta = data.read_meta(prefix)
    assert 100_000 < meta["num_tokens"] <= (512 << 10) + meta["num_documents"]
    cfg = model_config("tiny", vocab_size=257)
    ds = data.dataset_for("stdlib-small", cfg, seq_length=32, num_samples=50, seed=7)
    assert len(ds) >= 50
    item = ds[3]
    assert set(item) == {"tokens", "labels", "loss_mask", "position_ids"}
    for key in item:
        assert item[key].shape == (32,)
    assert item["tokens"].dtype == torch.int64 and item["loss_mask"].dtype == torch.float32
    assert torch.equal(item["position_ids"], torch.arange(32))
    assert int(item["tokens"].max()) < 257
    # labels are tokens shifted by one: the next item of the same sample window
    assert torch.equal(item["tokens"][1:], item["labels"][:-1])
    again = data.dataset_for("stdlib-small", cfg, seq_length=32, num_samples=50, seed=7)
    assert torch.equal(again[3]["tokens"], item["tokens"])  # deterministic by seed
    with_mask = data.dataset_for("stdlib-small", cfg, 32, 50, 7, attention_mask=True)
    assert with_mask[0]["attention_mask"].shape == (1, 32, 32)


def test_a_runs_samples_do_not_depend_on_its_length(tmp_path):
    """Megatron shuffles over as many epochs as the sample count needs; a run's sample k must not."""
    import types

    from mnb.megatron.batches import BatchPlan

    (tmp_path / "t.txt").write_text(" ".join(f"word{i % 97}" for i in range(3000)))
    cfg = model_config("tiny", vocab_size=257)
    epoch = len(data.dataset_for(str(tmp_path / "t.txt"), cfg, 64, 1, 5))
    sized = [data.dataset_for(str(tmp_path / "t.txt"), cfg, 64, n, 5) for n in (epoch, 3 * epoch)]
    first = lambda ds, n: [ds[i]["tokens"].tolist() for i in range(n)]  # noqa: E731
    assert first(sized[0], 8) != first(sized[1], 8)  # Megatron's order: by the requested count
    samples = BatchPlan(0, 2, 2, 1, 0).dataset(types.SimpleNamespace(data=str(tmp_path / "t.txt"), seed=5),
                                              types.SimpleNamespace(config=cfg))
    assert samples.epoch_size == epoch and first(samples, epoch) == first(sized[0], epoch)
    # the .bin/.idx the samples come from: what %mnb export passes Megatron-LM as --data-path
    assert samples.data_prefix == data.prepare(str(tmp_path / "t.txt"))
    assert BatchPlan(0, 2, 2, 1, 0).dataset(types.SimpleNamespace(data="mock", seed=5),
                                            types.SimpleNamespace(config=cfg)).data_prefix is None
    later = [samples[k]["tokens"].tolist() for k in range(epoch, 2 * epoch)]  # the second epoch:
    assert sorted(later) == sorted(first(sized[0], epoch)) and later != first(sized[0], epoch)  # reshuffled


def test_mock_dataset_fits_model_vocab():
    ds = data.dataset_for("mock", model_config("tiny", vocab_size=256), seq_length=16,
                          num_samples=20, seed=1)
    assert len(ds) >= 20
    assert int(max(ds[i]["tokens"].max() for i in range(20))) < 256


def test_existing_prefix_and_glob(corpus, tmp_path):
    prefix = data.build_indexed_dataset(data.resolve_text_files(corpus), str(tmp_path / "p"))
    cfg = model_config("tiny", vocab_size=257)
    for spec in (prefix, prefix + ".bin", str(corpus / "**" / "*.md"), str(corpus / "a.txt")):
        ds = data.dataset_for(spec, cfg, seq_length=8, num_samples=4, seed=0)
        assert ds[0]["tokens"].shape == (8,)


def test_clear_errors(corpus, tmp_path):
    cfg = model_config("tiny", vocab_size=257)
    with pytest.raises(FileNotFoundError, match="does not exist.*corpus preset"):
        data.dataset_for(str(tmp_path / "nope"), cfg, 8, 4, 0)
    with pytest.raises(FileNotFoundError, match="matches no files"):
        data.dataset_for(str(tmp_path / "*.nothing"), cfg, 8, 4, 0)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "zero.txt").write_text("")
    with pytest.raises(ValueError, match="has no text"):
        data.dataset_for(str(empty), cfg, 8, 4, 0)
    with pytest.raises(ValueError, match=r"token ids up to 256 .* vocab_size is 256.*>= 257"):
        data.dataset_for(str(corpus), model_config("tiny", vocab_size=256), 8, 4, 0)
    with pytest.raises(ValueError, match="num_samples must be a positive integer"):
        data.dataset_for("mock", cfg, 8, 0, 0)


def test_megatron_lm_reads_the_exported_data_in_the_notebooks_order(tmp_path, monkeypatch):
    """Megatron-LM's datasets for the exported ``--data-path``/``--split``/``--seed`` (bench/pretrain_gpt.py's
    provider, sized by Megatron-LM's own sample count for the run) hold the notebook's samples, in its order."""
    import sys
    import types

    arguments = pytest.importorskip("megatron.training.arguments",
                                    reason="megatron.training ships with megatron-core >= 0.17 (Python 3.12)")
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import global_vars, training

    from mnb.config import ParallelConfig, TrainConfig
    from mnb.megatron_lm.export_args import megatron_lm_args
    from mnb.megatron.batches import BatchPlan

    (tmp_path / "t.txt").write_text(" ".join(f"word{i % 89}" for i in range(6000)))
    cfg = model_config("tiny", vocab_size=512, seq_length=64)
    train = TrainConfig(steps=6, micro_batch_size=2, global_batch_size=4, data=str(tmp_path / "t.txt"), seed=7)
    plan = BatchPlan(0, 2, 2, 1, 0)
    samples = plan.dataset(train, types.SimpleNamespace(config=cfg))
    args_list, _ = megatron_lm_args(cfg, train, ParallelConfig().resolve(1), data_prefix=samples.data_prefix)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *args_list])
    args = arguments.parse_args()
    arguments.validate_args(args)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    monkeypatch.setattr(global_vars, "_GLOBAL_TOKENIZER", build_tokenizer(args))
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
    monkeypatch.syspath_prepend(bench)
    import pretrain_gpt

    counts = training.get_train_valid_test_num_samples()
    lm_train = pretrain_gpt.datasets_provider(counts)[0]
    assert counts[0] == 6 * 4 < samples.epoch_size  # the run stays within one epoch
    for step in range(6):  # Megatron-LM's sampler reads consecutive samples; mnb's plan, dp 1, the same
        for j in range(2):
            for k in plan.indices(step, j):
                for key in ("tokens", "labels", "loss_mask", "position_ids"):
                    assert torch.equal(torch.as_tensor(lm_train[k][key]), torch.as_tensor(samples[k][key])), (k, key)
