"""A Hugging Face checkpoint's own tokenizer on the ranks, and text data through it.

Folders are trained here with ``tokenizers`` (tests/megatron/hf_tokenizers.py); transformers'
``AutoTokenizer`` is the reference. The last test trains through a real 2-rank CPU pool.

    python -m pytest tests/megatron/test_tokenizer.py -q
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from hf_tokenizers import PARAGRAPH, gpt2_style, llama_style
from mnb.config import model_config
from mnb.megatron import data
from mnb.megatron.tokenizer import ByteTokenizer, HFTokenizer, load_hf_tokenizer

TEXT = 'def f(x):\n    return "na\u00efve \u2713 \u65e5\u672c"  # caf\u00e9\n\nclass A:\n    pass\n' + PARAGRAPH


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {"llama": llama_style(root / "llama"), "gpt2": gpt2_style(root / "gpt2")}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MNB_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_encodes_and_decodes_like_transformers(folders, style):
    from transformers import AutoTokenizer

    folder = folders[style]
    reference = AutoTokenizer.from_pretrained(str(folder))
    tok = load_hf_tokenizer(folder)
    ids = tok.tokenize(TEXT)
    assert ids == reference(TEXT).input_ids
    assert tok.detokenize(ids) == reference.decode(ids, skip_special_tokens=True) == TEXT
    assert tok.detokenize(ids, skip_special_tokens=False) == reference.decode(ids)
    assert tok.tokenize_documents([TEXT, "x"]) == [ids, reference("x").input_ids]
    assert (tok.eod, tok.eos, tok.bos) == (reference.eos_token_id,) * 2 + (reference.bos_token_id,)
    assert tok.vocab_size == len(reference) and tok.pad == -1  # no pad token: Megatron's "none"
    # Llama 3 adds its BOS when encoding (its post-processor); GPT-2 adds nothing.
    if style == "llama":
        assert tok.add_bos and ids[0] == tok.bos and tok.bos != tok.eod
    else:
        assert not tok.add_bos and ids[0] != tok.bos and tok.bos == tok.eod
    assert not tok.add_eos and ids[-1] != tok.eod
    starts = tok.offsets(ids, TEXT)
    assert len(starts) == len(ids) and starts == sorted(starts) and starts[-1] < len(TEXT)
    assert [f.name for f in tok.files] == ["tokenizer.json", "tokenizer_config.json"]
    json.dumps(dict(tok.unique_identifiers))  # Megatron hashes it as JSON


def test_fingerprint_follows_the_content_not_the_folder(folders, tmp_path):
    llama, gpt2 = load_hf_tokenizer(folders["llama"]), load_hf_tokenizer(folders["gpt2"])
    copy = shutil.copytree(folders["llama"], tmp_path / "elsewhere")
    assert load_hf_tokenizer(copy).fingerprint == llama.fingerprint != gpt2.fingerprint
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<|end_of_text|>"}))
    padded = load_hf_tokenizer(copy)
    assert padded.pad == padded.eod and padded.fingerprint != llama.fingerprint


def test_folders_without_a_usable_tokenizer(folders, tmp_path):
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    (weights_only / "config.json").write_text("{}")
    assert load_hf_tokenizer(weights_only) is None
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_hf_tokenizer(tmp_path / "missing")
    broken = shutil.copytree(folders["gpt2"], tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*tokenizer.json"):
        load_hf_tokenizer(broken)
    no_eos = shutil.copytree(folders["gpt2"], tmp_path / "no-eos")
    (no_eos / "tokenizer_config.json").write_text("{}")
    (no_eos / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="names no end-of-sequence token"):
        load_hf_tokenizer(no_eos)
    (no_eos / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match=r"eos_token '</s>' in .*tokenizer_config.json is not in the vocabulary"):
        load_hf_tokenizer(no_eos)
    # config.json's ids (a list, as Llama 3.1 writes eos_token_id) when the tokenizer files name none
    (no_eos / "tokenizer_config.json").write_text("{}")
    (no_eos / "config.json").write_text(json.dumps({"eos_token_id": [0, 5], "bos_token_id": 0}))
    assert (load_hf_tokenizer(no_eos).eod, load_hf_tokenizer(no_eos).bos) == (0, 0)


def test_text_data_through_the_checkpoint_tokenizer(folders, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    corpus = tmp_path / "texts"
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXT)
    (corpus / "b.md").write_text(PARAGRAPH)
    llama, gpt2 = load_hf_tokenizer(folders["llama"]), load_hf_tokenizer(folders["gpt2"])
    prefixes = {name: data.prepare(str(corpus), tok)
                for name, tok in (("byte", None), ("llama", llama), ("gpt2", gpt2))}
    assert len(set(prefixes.values())) == 3  # the cache keys on the tokenizer
    assert data.prepare(str(corpus)) == prefixes["byte"]  # the byte tokenizer's key is unchanged
    assert data.prepare(str(corpus), load_hf_tokenizer(folders["llama"])) == prefixes["llama"]
    for name, tok in (("llama", llama), ("gpt2", gpt2)):
        docs = IndexedDataset(prefixes[name])
        assert [docs[i].tolist() for i in range(len(docs))] == [
            tok.tokenize(TEXT) + [tok.eod], tok.tokenize(PARAGRAPH) + [tok.eod]]
        assert data.read_meta(prefixes[name])["tokenizer"]["fingerprint"] == tok.fingerprint
    first = IndexedDataset(prefixes["llama"])  # kept: its items are views of its mmap
    assert first[0][0] == llama.bos  # each document starts with Llama's BOS
    # Megatron's GPTDataset over it: ids inside the model's vocabulary, labels shifted
    cfg = model_config("tiny", vocab_size=llama.vocab_size)
    ds = data.dataset_for(str(corpus), cfg, seq_length=16, num_samples=8, seed=0, tokenizer=llama)
    item = ds[0]
    assert int(item["tokens"].max()) < llama.vocab_size and bool((item["loss_mask"] == 1).all())
    assert np.array_equal(item["tokens"][1:].numpy(), item["labels"][:-1].numpy())
    # refused: a vocabulary smaller than the tokenizer's; a prefix of another tokenizer's ids
    with pytest.raises(ValueError, match=r"vocab_size is 300; .*>= \d+ \(its tokenizer: HFTokenizer"):
        data.dataset_for(str(corpus), model_config("tiny", vocab_size=300), 16, 8, 0, tokenizer=llama)
    with pytest.raises(ValueError, match="tokenized by mnb with HFTokenizer .*pass the text files"):
        data.dataset_for(prefixes["llama"], cfg, 16, 8, 0, tokenizer=gpt2)
    with pytest.raises(ValueError, match="tokenized by mnb with HFTokenizer"):
        data.dataset_for(prefixes["gpt2"], model_config("tiny", vocab_size=512), 16, 8, 0)
    # a model without a tokenizer of its own reads text with the byte tokenizer only if its vocabulary allows
    with pytest.raises(ValueError, match=r"the model has no tokenizer of its own\), but the model's vocab_size is 200"):
        data.dataset_for(str(corpus), model_config("tiny", vocab_size=200), 16, 8, 0)
    assert isinstance(llama, HFTokenizer) and not isinstance(ByteTokenizer(), HFTokenizer)


def test_folder_and_glob_rules(tmp_path):
    hidden_only = tmp_path / "hidden"
    hidden_only.mkdir()
    (hidden_only / ".notes").write_text("hidden")
    (hidden_only / "blob").write_bytes(b"\0binary")
    with pytest.raises(FileNotFoundError, match=r"holds no text files \(hidden files aside, 1 file\(s\), all binary\).*NUL byte"):
        data.resolve_text_files(hidden_only)
    with pytest.raises(FileNotFoundError, match=r"glob '.*\*\*/\*\.rst' matches no files"):
        data.resolve_text_files(str(tmp_path / "**" / "*.rst"))


@pytest.fixture(scope="module")
def llama_checkpoint(folders, tmp_path_factory):
    """A tiny random LlamaForCausalLM saved by transformers beside the Llama-style tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = shutil.copytree(folders["llama"], tmp_path_factory.mktemp("ckpt") / "llama")
    tok = load_hf_tokenizer(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2,
        vocab_size=tok.vocab_size, max_position_embeddings=64, bos_token_id=tok.bos, eos_token_id=tok.eod,
    )).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_training_on_text_through_the_checkpoint_tokenizer(cpu_pool, llama_checkpoint, tmp_path):
    """mnb.from_hf sets the checkpoint's tokenizer; mnb.train(data=text) reads the text through it."""
    import mnb

    text = tmp_path / "story.txt"
    text.write_text(PARAGRAPH * 30)
    cpu_pool.run(
        "import os\n"
        f"os.environ['MNB_CACHE'] = {str(tmp_path / 'rank-cache')!r}\n"
        "from mnb.megatron.data import prepare, read_meta\n"
        f"model = mnb.from_hf({str(llama_checkpoint)!r}, seq_length=32)\n"
        f"mnb.train(model, steps=12, micro_batch_size=2, global_batch_size=4, lr=3e-3, data={str(text)!r})\n"
        f"meta = read_meta(prepare({str(text)!r}, model.tokenizer))",
        quiet=True,
    )
    losses = mnb.last_run.losses
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5, losses
    metas = cpu_pool.run("meta")
    tok = load_hf_tokenizer(llama_checkpoint)
    assert [m["tokenizer"]["fingerprint"] for m in metas.values()] == [tok.fingerprint, tok.fingerprint]
    assert metas[0]["num_documents"] == 1 and metas[0]["max_token_id"] < tok.vocab_size
    assert metas[0]["num_tokens"] == len(tok.tokenize(PARAGRAPH * 30)) + 1  # [BOS] text [EOS]
    # the run records name the tokenizer, so %mnb export writes --tokenizer-model FOLDER
    from mnb.controller.registry import last_settings

    assert last_settings()["tokenizer"] == str(llama_checkpoint)
