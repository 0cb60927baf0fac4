"""A Hugging Face checkpoint folder wherever the notebook side takes a preset name (no ranks, no torch).

The estimators, ``%mnb plan --model PATH``, ``mnb.explorer(model=PATH)`` and ``%mnb export
--model PATH`` read the folder's config.json through ``mnb.hf_config``; the export names the
checkpoint's tokenizer. Folders: tests/hf_folders.py (real checkpoints' configs, no weights).
"""

from __future__ import annotations

import pytest
from hf_folders import checkpoint
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from traitlets import TraitError

import mnb
import mnb.estimate as est
from mnb.config import ParallelConfig, TrainConfig
from mnb.controller import registry
from mnb.controller.preflight import cell_settings
from mnb.megatron_lm.exports import export
from mnb.hf_config import hf_config
from mnb.model_source import resolve_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {"llama": checkpoint(root, "Llama-3.2-1B", tokenizer_ids=128256),
            "qwen": checkpoint(root, "Qwen2.5-0.5B", tokenizer_ids=151665),
            "gpt2": checkpoint(root, "gpt2")}


@pytest.fixture(autouse=True)
def fresh_notebook(monkeypatch):
    monkeypatch.setattr(registry, "_LAST_RUN", [])
    monkeypatch.setattr(registry, "_SETTINGS", {})


def pairs(args) -> dict[str, str | None]:
    return {w: (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None)
            for i, w in enumerate(args) if w.startswith("--")}


def test_a_folder_or_its_config_json_is_the_checkpoints_model(folders, tmp_path):
    llama = folders["llama"]
    assert resolve_model(llama) == resolve_model(str(llama / "config.json")) == hf_config(llama)
    assert resolve_model(llama, num_layers=4).num_layers == 4
    assert resolve_model("tiny").name == "tiny"  # presets as before
    with pytest.raises(ValueError, match="does not exist: pass a Hugging Face checkpoint folder"):
        resolve_model(str(tmp_path / "Llama-missing"))
    with pytest.raises(ValueError, match="is a folder without config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ValueError, match="unknown model preset 'llama-9z'"):
        resolve_model("llama-9z")


def test_estimators_and_plan_take_the_folder(folders, capsys):
    train = TrainConfig(bf16=True, global_batch_size=64, use_distributed_optimizer=True)
    for folder in folders.values():
        cfg = hf_config(folder)
        assert est.memory(folder, ParallelConfig(tp=2), train, gpus=8) == est.memory(cfg, ParallelConfig(tp=2),
                                                                                     train, gpus=8)
        assert est.flops(folder, train) == est.flops(cfg, train)
        assert est.step_time(folder, ParallelConfig(tp=2), train, gpus=8) == est.step_time(
            cfg, ParallelConfig(tp=2), train, gpus=8)
    qwen = hf_config(folders["qwen"])
    rows = est.plan(str(folders["qwen"]), 8, gpu="h200", gbs=64)
    assert rows and rows == est.plan(qwen, 8, gpu="h200", gbs=64)
    # Qwen2's q/k/v biases count: (14 + 2 * 2) heads * 64 per layer
    assert est.layer_params(qwen)[0] - est.layer_params(qwen.with_overrides(add_qkv_bias=False))[0] == 18 * 64
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    capsys.readouterr()
    shell.run_line_magic("mnb", f"plan --model {folders['llama']} --gpus 8 --top 3")
    out = capsys.readouterr().out
    assert est.format_plan(est.plan(hf_config(folders["llama"]), 8, gpu="h200")[:3]) in out
    with pytest.raises(UsageError, match="does not exist"):
        shell.run_line_magic("mnb", "plan --model ./no-such-checkpoint --gpus 8")


def test_explorer_opens_on_the_folder(folders, tmp_path):
    cfg = hf_config(folders["qwen"])
    ex = mnb.explorer(model=folders["qwen"], gpus=8, gpu="h200", bf16=True, global_batch_size=64)
    assert (ex.num_layers, ex.hidden_size, ex.num_attention_heads, ex.num_query_groups, ex.ffn_hidden_size) == (
        24, 896, 14, 2, 4864)
    assert ex.model_config() == cfg and ex.predicted["peak_bytes"] > 0
    assert ex.options["tp"] == [1, 2] and "4" in ex.unavailable["tp"]  # 2 query groups
    assert str(folders["qwen"]) in ex.controls["model"].options
    ex.num_layers = 12
    assert ex.model_config() == cfg.with_overrides(num_layers=12)
    ex.model = "tiny"
    assert ex.num_layers == 4
    bad = checkpoint(tmp_path, "gpt2")
    (bad / "config.json").write_text('{"architectures": ["BertForMaskedLM"]}')
    with pytest.raises(TraitError, match="BertForMaskedLM is not supported"):
        ex.model = str(bad)


def test_export_names_the_checkpoints_tokenizer_and_shape(folders):
    llama = export("megatron-lm", model=str(folders["llama"]), gpus_per_node=8, layout=ParallelConfig(tp=2))
    got = pairs(llama.args)
    assert (got["--tokenizer-type"], got["--tokenizer-model"]) == ("HuggingFaceTokenizer", str(folders["llama"]))
    assert llama.tokenizer == str(folders["llama"]) and "--vocab-size" not in got
    assert (got["--rotary-base"], got["--rope-scaling-factor"], got["--normalization"]) == ("500000", "32.0", "RMSNorm")
    assert (got["--position-embedding-type"], got["--num-query-groups"]) == ("rope", "8")
    assert "--kv-channels" not in got  # head_dim 64 = 2048 / 32
    for flag in ("--use-rope-scaling", "--swiglu", "--disable-bias-linear", "--group-query-attention"):
        assert flag in got and got[flag] is None, flag
    assert "--untie-embeddings-and-output-weights" not in got and "--add-qkv-bias" not in got  # tied, no biases
    assert any("starts from random weights" in n for n in llama.notes)
    assert not any("sizes the embedding from the tokenizer" in n for n in llama.notes)  # 128256 both

    qwen = export("megatron-lm", model=folders["qwen"], gpus_per_node=2)
    got = pairs(qwen.args)
    assert "--add-qkv-bias" in got and "--disable-bias-linear" in got and "--use-rope-scaling" not in got
    assert got["--rotary-base"] == "1000000" and got["--norm-epsilon"] == "1e-06"
    assert any("tokenizer (151665 ids" in n and "151936 rows" in n for n in qwen.notes)

    gpt2 = export("megatron-lm", model=folders["gpt2"], gpus_per_node=1)
    got = pairs(gpt2.args)
    assert (got["--tokenizer-type"], got["--vocab-size"]) == ("NullTokenizer", "50257")  # no tokenizer.json
    assert (got["--position-embedding-type"], got["--normalization"]) == ("learned_absolute", "LayerNorm")
    assert "--openai-gelu" in got and "--disable-bias-linear" not in got and "--swiglu" not in got
    assert "--untie-embeddings-and-output-weights" not in got and gpt2.tokenizer is None


def test_export_remembers_the_checkpoint_of_the_last_cell_and_run(folders, capsys):
    qwen = str(folders["qwen"])
    registry.remember_settings(**cell_settings(f"model = mnb.from_hf({qwen!r}, num_layers=2)\n"
                                               "mnb.train(model, steps=3, micro_batch_size=1, global_batch_size=8)"))
    e = export("megatron-lm", gpus_per_node=8)
    assert (e.model.num_layers, e.tokenizer, pairs(e.args)["--train-iters"]) == (2, qwen, "3")
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    capsys.readouterr()
    shell.run_line_magic("mnb", "export --gpus-per-node 2")
    out = capsys.readouterr().out
    assert f"--tokenizer-model {qwen}" in out and "--add-qkv-bias" in out
    registry.remember_settings(**cell_settings("model = mnb.gpt('tiny')"))  # another model: no tokenizer
    assert "HuggingFaceTokenizer" not in export("megatron-lm", gpus_per_node=2).args
