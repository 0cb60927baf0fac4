"""Hugging Face checkpoints on real CPU ranks: from_hf -> logits under every layout -> train -> save_hf -> back.

Tiny random checkpoints are built here with transformers (no downloads): Llama (GQA, untied),
Qwen2 (q/k/v biases, tied), Mixtral (4 experts, top-2) and GPT-2 (LayerNorm with biases,
gelu_new, Conv1D, learned positions, tied).  transformers' own logits, computed once in this
process, are the reference for ``mnb.logits`` under each layout; one cell per layout checks
every architecture (a layout change is in-process).  One 2-rank pool for the module, one
4-rank pool for tp2*pp2.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import mnb
from mnb.config import ParallelConfig
from mnb.errors import CompositeRankError
from tests.megatron.hf_reference import reference_logits

pytestmark = pytest.mark.slow

LAYERS = 4  # pp2 * vpp2 needs 4
TOKENS = 13  # odd: sequence and context parallelism pad it
ATOL = 1e-4
TEXT = "The notebook kernel drives a pool of ranks."


def _build(folder, kind: str, *, dtype=None, shard: str | None = None):
    import torch
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                              MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    torch.manual_seed({"llama": 1, "qwen2": 2, "mixtral": 3, "gpt2": 4}[kind])
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                 num_hidden_layers=LAYERS, vocab_size=300, max_position_embeddings=64, initializer_range=0.1)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**small, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**small, tie_word_embeddings=True))
    elif kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2))
    else:
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=4, n_layer=LAYERS, vocab_size=300, n_positions=64,
                                           initializer_range=0.1, bos_token_id=0, eos_token_id=0))
    with torch.no_grad():  # random biases and norms, so a wrong mapping of them shows in the logits
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, reference logits); the token ids shared by every cell."""
    root = tmp_path_factory.mktemp("hf")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=(2, TOKENS)).tolist()
    out = {}
    for kind in ("llama", "qwen2", "mixtral", "gpt2"):
        folder = root / kind
        _build(folder, kind)
        out[kind] = (str(folder), reference_logits(folder, tokens))
    from hf_tokenizers import llama_style  # a tokenizer trained here on local text: save_hf copies it

    tokenizer = llama_style(root / "tokenizer", vocab_size=300)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, root / "llama" / name)
    sharded = root / "llama-bf16-sharded"
    import torch

    _build(sharded, "llama", dtype=torch.bfloat16, shard="40KB")
    out["llama-bf16-sharded"] = (str(sharded), reference_logits(sharded, tokens))
    return {"models": out, "tokens": tokens, "root": root}


def _logits_cell(models: dict, tokens, kwargs: dict | None = None) -> str:
    paths = {name: folder for name, (folder, _) in models.items()}
    return (f"_out = {{}}\n"
            f"for _name, _path in {paths!r}.items():\n"
            f"    _m = mnb.from_hf(_path, **{kwargs or {}!r}.get(_name, {{}}))\n"
            f"    _out[_name] = mnb.logits(_m, {tokens!r}).numpy()\n"
            f"del _m\n"
            f"_out")


def _check(results: dict, models: dict, label: str) -> None:
    for rank, per_model in results.items():
        assert set(per_model) == set(models), (label, rank)
        for name, got in per_model.items():
            want = models[name][1]
            assert got.shape == want.shape, (label, rank, name, got.shape)
            err = float(np.abs(got - want).max())
            assert err < ATOL, f"{label} rank {rank} {name}: max |mnb - transformers| = {err:.2e}"


LAYOUTS_2 = {
    "1 rank (dp2)": (ParallelConfig(), ("llama", "qwen2", "mixtral", "gpt2", "llama-bf16-sharded")),
    "tp2": (ParallelConfig(tp=2), ("llama", "qwen2", "gpt2")),
    "tp2+sp": (ParallelConfig(tp=2, sequence_parallel=True), ("llama", "qwen2", "mixtral", "gpt2")),
    "pp2": (ParallelConfig(pp=2), ("llama", "qwen2", "mixtral", "gpt2")),
    "pp2-vpp2": (ParallelConfig(pp=2, vpp=2), ("llama", "qwen2", "mixtral", "gpt2")),
    "cp2": (ParallelConfig(cp=2), ("llama", "qwen2", "mixtral", "gpt2")),
    "ep2": (ParallelConfig(ep=2), ("mixtral",)),
}


@pytest.mark.parametrize("label", list(LAYOUTS_2))
def test_logits_equal_transformers_under_each_layout(cpu_pool, checkpoints, label):
    layout, names = LAYOUTS_2[label]
    models = {n: checkpoints["models"][n] for n in names}
    results = cpu_pool.run(_logits_cell(models, checkpoints["tokens"]), layout=layout, quiet=True)
    _check(results, models, label)


def test_train_save_hf_and_back_under_another_layout(cpu_pool, checkpoints):
    """from_hf -> 3 steps -> save_hf (pp2: each stage writes its shards; tied Qwen2 across stages) and mnb.save;
    transformers loads the folder with mnb's logits; tp2 reads it back, and mnb.load restores the same model."""
    models, tokens, root = checkpoints["models"], checkpoints["tokens"], checkpoints["root"]
    names = ("llama", "qwen2")
    paths = {n: models[n][0] for n in names}
    out = {n: str(root / f"trained-{n}") for n in names}
    trained = cpu_pool.run(
        "_res = {}\n"
        f"for _name, _path in {paths!r}.items():\n"
        "    _m = mnb.from_hf(_path)\n"
        "    _run = mnb.train(_m, steps=3, micro_batch_size=2, global_batch_size=2, lr=1e-2, data='mock')\n"
        "    _res[_name + '-norm'] = _run['steps'][0]['grad_norm']\n"
        f"    mnb.save_hf({out!r}[_name], _m, max_shard_bytes=100_000)\n"
        f"    mnb.save({str(root / 'dist-llama')!r} if _name == 'llama' else {str(root / 'dist-qwen2')!r}, _m)\n"
        f"    _res[_name] = mnb.logits(_m, {tokens!r}).numpy()\n"
        "_res", layout=ParallelConfig(pp=2), quiet=True)
    assert np.array_equal(trained[0]["llama"], trained[1]["llama"])
    for name in names:
        mine = trained[0][name]
        assert float(np.abs(mine - models[name][1]).max()) > 1e-2, "training changed nothing"
        folder = root / f"trained-{name}"
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and all((folder / f).stat().st_size < 100_000 + 4096 for f in shards), shards
        assert (name == "qwen2") == ("lm_head.weight" not in index["weight_map"])
        err = float(np.abs(reference_logits(folder, tokens) - mine).max())
        assert err < ATOL, f"{name}: transformers on mnb.save_hf's folder differs by {err:.2e}"
    assert not list(root.glob("trained-*.tmp-*"))
    back = cpu_pool.run(
        "_res = {}\n"
        f"for _name, _path in {out!r}.items():\n"
        "    _res[_name] = mnb.logits(mnb.from_hf(_path), " + repr(tokens) + ").numpy()\n"
        f"_m = mnb.from_hf({paths['llama']!r})\n"
        f"mnb.load({str(root / 'dist-llama')!r}, _m)\n"
        f"_res['dist'] = mnb.logits(_m, {tokens!r}).numpy()\n"
        f"_res['tokens'] = mnb.from_hf({out['llama']!r}).tokenizer.tokenize({TEXT!r})\n"
        f"_g = mnb.from_hf({paths['llama']!r})\n"  # the first step's gradient norm counts every tp shard
        "_res['norm'] = mnb.train(_g, steps=1, micro_batch_size=2, global_batch_size=2, lr=1e-2, data='mock')"
        "['steps'][0]['grad_norm']\n"
        "_res", layout=ParallelConfig(tp=2), quiet=True)
    for rank in back:
        for name in names:
            assert float(np.abs(back[rank][name] - trained[0][name]).max()) < ATOL, (rank, name)
        assert float(np.abs(back[rank]["dist"] - trained[0]["llama"]).max()) < ATOL, rank
        # pp2 (no tp) and tp2 see the same model, data and batch: one gradient norm (tp2 counted rank 0's shards only)
        assert back[rank]["norm"] == pytest.approx(trained[0]["llama-norm"], rel=1e-4), rank
    from tokenizers import Tokenizer

    assert (root / "trained-llama" / "tokenizer_config.json").is_file()
    want = Tokenizer.from_file(str(root / "llama" / "tokenizer.json")).encode(TEXT).ids
    assert back[0]["tokens"] == back[1]["tokens"] == want and len(want) > 3


def _config_only(root, name: str, **config) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_bad_input_is_refused_alike_on_every_rank(cpu_pool, checkpoints):
    models, root = checkpoints["models"], checkpoints["root"] / "bad"
    root.mkdir()
    llama = json.loads((root.parent / "llama" / "config.json").read_text())
    no_weights = _config_only(root, "no-weights", **llama)
    bert = _config_only(root, "bert", architectures=["BertForMaskedLM"], model_type="bert")
    wrong = root / "wrong-shape"
    shutil.copytree(models["llama"][0], wrong)
    (wrong / "config.json").write_text(json.dumps({**llama, "intermediate_size": 128}))
    missing = root / "missing-shard"
    shutil.copytree(models["llama-bf16-sharded"][0], missing)
    lost = sorted(missing.glob("model-*.safetensors"))[1]
    lost.unlink()
    three_heads = _config_only(root, "three-heads", **{**llama, "num_attention_heads": 3, "num_key_value_heads": 3,
                                                       "hidden_size": 48, "head_dim": 16})
    one_group = _config_only(root, "one-group", **{**llama, "num_key_value_heads": 1})
    mixtral = json.loads((root.parent / "mixtral" / "config.json").read_text())
    three_experts = _config_only(root, "three-experts", **{**mixtral, "num_local_experts": 3})
    cases = [  # (folder, layout, fragments of the one message)
        (no_weights, ParallelConfig(), ["no-weights holds no weights: neither model.safetensors nor "
                                        "model.safetensors.index.json"]),
        (bert, ParallelConfig(), ["bert/config.json: architecture BertForMaskedLM is not supported; mnb.from_hf "
                                  "reads LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM, "
                                  "GPT2LMHeadModel"]),
        (str(wrong), ParallelConfig(), ["wrong-shape/model.safetensors: model.layers.0.mlp.gate_proj.weight has "
                                        "shape [96, 64], but ", "wrong-shape/config.json implies [128, 64]"]),
        (str(missing), ParallelConfig(), [f"model.safetensors.index.json names shard {lost.name}, which is missing"]),
        (three_heads, ParallelConfig(tp=2), ["three-heads (LlamaForCausalLM) under tp2 pp1 dp1: "
                                             "num_attention_heads(3) is not divisible by tp(2)"]),
        (one_group, ParallelConfig(tp=2), ["num_query_groups(1) is not divisible by tp(2)"]),
        (three_experts, ParallelConfig(ep=2), ["num_moe_experts(3) is not divisible by ep(2)"]),
    ]
    for folder, layout, fragments in cases:
        with pytest.raises(CompositeRankError, match="2 of 2 ranks raised") as info:
            cpu_pool.run(f"mnb.from_hf({folder!r})", layout=layout, quiet=True)
        text = str(info.value)
        assert "[r0-1] ValueError" in text, text  # one error, the same on both ranks
        assert all(f in text for f in fragments), text
    # the pool is still usable: the sharded bf16 checkpoint loads after all that
    assert cpu_pool.run(f"mnb.from_hf({models['llama-bf16-sharded'][0]!r}).config.num_layers", quiet=True,
                        layout=ParallelConfig()) == \
        {0: LAYERS, 1: LAYERS}


def test_corner_folders_read_as_transformers_reads_them(cpu_pool, checkpoints, tmp_path):
    """Folders transformers reads in a way that is easy to miss: a Llama with biases on every linear (read,
    and written back by save_hf as one), a tied config whose weights hold their own lm_head (transformers 5
    uses it), a folder holding one file and an index of other shards (transformers reads the file), and a
    Mistral whose sliding window is shorter than the tokens (Megatron's local attention has none: refused)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    tokens = checkpoints["tokens"]
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                 num_hidden_layers=2, vocab_size=300, max_position_embeddings=64, initializer_range=0.1)
    torch.manual_seed(11)
    biased = LlamaForCausalLM(LlamaConfig(**small, attention_bias=True, mlp_bias=True))
    with torch.no_grad():
        for p in biased.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    biased.save_pretrained(tmp_path / "biased")
    untied = LlamaForCausalLM(LlamaConfig(**small, tie_word_embeddings=False))
    untied.save_pretrained(tmp_path / "own-head")
    config = json.loads((tmp_path / "own-head" / "config.json").read_text())
    (tmp_path / "own-head" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    untied.save_pretrained(tmp_path / "both", max_shard_size="40KB")  # shards and an index ...
    other = LlamaForCausalLM(LlamaConfig(**small))
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(tmp_path / "both" / "model.safetensors"),
              metadata={"format": "pt"})  # ... and one file of other weights beside them
    MistralForCausalLM(MistralConfig(**small, sliding_window=8)).save_pretrained(tmp_path / "window")
    window_tokens = [row[:8] for row in tokens]
    want = {name: reference_logits(tmp_path / name, tokens) for name in ("biased", "own-head", "both")}
    want["window"] = reference_logits(tmp_path / "window", window_tokens)
    assert float(np.abs(want["both"] - reference_logits(tmp_path / "own-head", tokens)).max()) > 0.1

    cell = (f"_out = {{}}\n"
            f"for _name in ('biased', 'own-head', 'both', 'window'):\n"
            f"    _m = mnb.from_hf({str(tmp_path)!r} + '/' + _name)\n"
            f"    _out[_name] = mnb.logits(_m, {window_tokens!r} if _name == 'window' else {tokens!r}).numpy()\n"
            f"    if _name == 'biased':\n"
            f"        mnb.save_hf({str(tmp_path / 'biased-saved')!r}, _m)\n"
            f"_seq = _m.config.seq_length\n"
            f"del _m\n"
            f"(_out, _seq)")
    results = cpu_pool.run(cell, layout=ParallelConfig(tp=2), quiet=True)
    for rank, (got, seq) in results.items():
        assert seq == 8  # the window's length, where config.json's positions are 64
        for name, logits in got.items():
            err = float(np.abs(logits - want[name]).max())
            assert err < ATOL, f"rank {rank} {name}: max |mnb - transformers| = {err:.2e}"
    saved = json.loads((tmp_path / "biased-saved" / "config.json").read_text())
    assert (saved["architectures"], saved["attention_bias"], saved["mlp_bias"]) == (["LlamaForCausalLM"], True, True)
    assert float(np.abs(reference_logits(tmp_path / "biased-saved", tokens) - want["biased"]).max()) < ATOL
    for code, fragment in (
            (f"mnb.logits(mnb.from_hf({str(tmp_path / 'window')!r}), {tokens!r})",
             "13 tokens exceed this model's sliding_window (8)"),
            (f"mnb.generate(mnb.from_hf({str(tmp_path / 'window')!r}), [[5, 6, 7, 8, 9, 10]], max_new_tokens=3, "
             "stream=False)", "= 9 exceeds the model's sliding_window (Megatron's local attention has none) (8)"),
            (f"mnb.logits(mnb.from_hf({str(tmp_path / 'biased')!r}), [[]])",
             "token_ids must be [batch, tokens] with at least one token, got shape [1, 0]")):
        with pytest.raises(CompositeRankError, match="2 of 2 ranks raised") as info:
            cpu_pool.run(code, layout=ParallelConfig(), quiet=True)
        assert "[r0-1] ValueError" in str(info.value) and fragment in str(info.value), str(info.value)


SP = {"mixtral": {"sequence_parallel": True}}  # Megatron trains MoE under tp > 1 only with sp


def test_tp2_pp2_logits_and_save_hf_of_every_architecture(pool4, checkpoints):
    """4 ranks, tp2*pp2: logits of all four equal transformers'; save_hf of each (tp-gathered q/k/v, gated fc1,
    Conv1D, experts, tied embeddings across stages) loads in transformers with the same logits."""
    names = ("llama", "qwen2", "mixtral", "gpt2")
    models = {n: checkpoints["models"][n] for n in names}
    tokens, root = checkpoints["tokens"], checkpoints["root"]
    out = {n: str(root / f"tp2pp2-{n}") for n in names}
    cell = _logits_cell(models, tokens, SP).replace(
        "    _out[_name] = mnb.logits(_m, ",
        f"    mnb.save_hf({out!r}[_name], _m)\n    _out[_name] = mnb.logits(_m, ")
    results = pool4.run(cell, layout=ParallelConfig(tp=2, pp=2), quiet=True)
    _check(results, models, "tp2*pp2")
    for name in names:
        err = float(np.abs(reference_logits(out[name], tokens) - models[name][1]).max())
        assert err < ATOL, f"{name}: transformers on save_hf's tp2*pp2 folder differs by {err:.2e}"


def test_save_hf_under_ep2_and_from_an_mnb_gpt_model(cpu_pool, checkpoints):
    """ep2: each expert rank writes its own experts; an mnb.gpt model of Llama shape saves as LlamaForCausalLM."""
    tokens, root = checkpoints["tokens"], checkpoints["root"]
    mixtral, gpt = str(root / "ep2-mixtral"), str(root / "gpt-tiny")
    results = cpu_pool.run(
        f"_m = mnb.from_hf({checkpoints['models']['mixtral'][0]!r})\n"
        f"mnb.save_hf({mixtral!r}, _m, max_shard_bytes=200_000)", layout=ParallelConfig(ep=2), quiet=True)
    results = cpu_pool.run(
        f"_g = mnb.gpt('tiny', vocab_size=300)\n"
        f"mnb.save_hf({gpt!r}, _g)\n"
        f"mnb.logits(_g, {tokens!r}).numpy()", layout=ParallelConfig(pp=2), quiet=True)
    index = json.loads((root / "ep2-mixtral" / "model.safetensors.index.json").read_text())
    by_file: dict[str, set] = {}
    for key, file in index["weight_map"].items():
        if ".experts." in key:
            by_file.setdefault(file, set()).add(int(key.split(".experts.")[1].split(".")[0]))
    assert set().union(*by_file.values()) == {0, 1, 2, 3}
    assert all(e <= {0, 1} or e <= {2, 3} for e in by_file.values()), by_file  # each rank its own experts
    err = float(np.abs(reference_logits(mixtral, tokens) - checkpoints["models"]["mixtral"][1]).max())
    assert err < ATOL, err
    saved = json.loads((root / "gpt-tiny" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["num_key_value_heads"] == 2
    err = float(np.abs(reference_logits(gpt, tokens) - results[0]).max())
    assert err < ATOL, err


def _siblings(folder) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(folder.name))


def test_save_hf_keeps_a_users_files_and_finishes_a_crashed_swap(cpu_pool, checkpoints):
    """A folder of the user's files is refused alike on every rank (the pool stays usable); with overwrite=True,
    and on every later save, notes.txt and sub/ stay; a save stopped between its two renames is read by
    from_hf meanwhile and finished by the next save_hf."""
    tokens, out = checkpoints["tokens"], checkpoints["root"] / "users" / "out"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "sub" / "data.csv").write_text("1,2")
    model = "_g = mnb.gpt('tiny', vocab_size=300, num_layers=2)\n"
    with pytest.raises(CompositeRankError, match="2 of 2 ranks raised") as info:
        cpu_pool.run(model + f"mnb.save_hf({str(out)!r}, _g)", quiet=True)
    text = str(info.value)
    assert "[r0-1] OverwriteRefusedError: mnb.save_hf: " in text, text  # one error, the same on both ranks
    assert "out is not empty and holds no Hugging Face checkpoint: notes.txt, sub/ (2 entries)" in text, text
    assert "overwrite=True" in text, text
    assert _siblings(out) == ["out"] and sorted(p.name for p in out.iterdir()) == ["notes.txt", "sub"]

    def kept():
        assert (out / "notes.txt").read_text() == "mine" and (out / "sub" / "data.csv").read_text() == "1,2"

    cpu_pool.run(model + f"mnb.save_hf({str(out)!r}, _g, overwrite=True)", quiet=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt", "sub"]
    kept()
    cpu_pool.run(f"mnb.save_hf({str(out)!r}, _g)", quiet=True)  # its own kind now: no flag needed
    kept()
    newer = out.with_name("newer")
    cpu_pool.run(f"_n = mnb.gpt('tiny', vocab_size=300, num_layers=2, seed=7)\nmnb.save_hf({str(newer)!r}, _n)",
                 quiet=True)
    newer.rename(out.with_name("out.tmp-crashed"))  # the new folder complete beside the old one,
    out.rename(out.with_name("out.old-crashed"))  # the old one moved aside; the second rename never came
    diffs = cpu_pool.run(f"float((mnb.logits(mnb.from_hf({str(out)!r}), {tokens!r}) - mnb.logits(_n, {tokens!r}))"
                         ".abs().max())", quiet=True)
    assert diffs == {0: 0.0, 1: 0.0}  # from_hf read the new folder
    cpu_pool.run(f"mnb.save_hf({str(out)!r}, _g)", quiet=True)
    assert _siblings(out) == ["out"]
    kept()


def test_each_rank_reads_only_its_slices_once(cpu_pool, checkpoints):
    """model.hf.read on real ranks: under tp2 the two ranks share only the replicated norms, under pp2
    nothing; each rank reads every byte range at most once, and together they read the whole checkpoint."""
    from mnb.megatron.hf.reader import Checkpoint

    folder = checkpoints["models"]["llama-bf16-sharded"][0]
    tensors = Checkpoint(folder).tensors
    total = sum(i.end - i.begin for i in tensors.values())
    norms = sum(i.end - i.begin for name, i in tensors.items() if name.endswith("norm.weight"))
    cell = (f"_r = mnb.from_hf({folder!r}).hf.read\n"
            "sorted((s.file, a, b) for s in _r.spans for a, b in s.ranges()), _r.bytes_read")
    for layout, shared in ((ParallelConfig(tp=2), norms), (ParallelConfig(pp=2), 0)):
        got = cpu_pool.run(cell, layout=layout, quiet=True)
        (ranges0, read0), (ranges1, read1) = got[0], got[1]
        for ranges, read in ((ranges0, read0), (ranges1, read1)):
            assert read == sum(b - a for _, a, b in ranges), layout
            assert all(f0 != f1 or b0 <= a1 for (f0, _, b0), (f1, a1, _) in zip(ranges, ranges[1:])), layout
        bytes0, bytes1 = ({(f, x) for f, a, b in r for x in range(a, b)} for r in (ranges0, ranges1))
        assert len(bytes0 & bytes1) == shared and len(bytes0 | bytes1) == total, layout.describe()
        assert read0 + read1 == total + shared, (layout.describe(), read0, read1, total, shared)
        assert max(read0, read1) < 0.7 * total, (layout.describe(), read0, read1, total)
