"""mnb.hf_config: config.json -> ModelConfig, torch-free (configs written by transformers itself)."""

from __future__ import annotations

import json

import pytest

import mnb
from mnb.hf_config import ARCHITECTURES, hf_config, to_hf_config


def _save(tmp_path, name: str, config) -> str:
    folder = tmp_path / name
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM" if "GPT2" not in type(config).__name__
                                                          else "LMHeadModel")]
    config.save_pretrained(folder)
    return str(folder)


def _edit(folder, **changes) -> str:
    path = f"{folder}/config.json"
    data = json.load(open(path))
    data.update(changes)
    json.dump(data, open(path, "w"))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config

    tmp = tmp_path_factory.mktemp("hfconf")
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                 num_hidden_layers=2, vocab_size=300, max_position_embeddings=256)
    return {
        "llama": _save(tmp, "llama", LlamaConfig(**small, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192})),
        "mistral": _save(tmp, "mistral", MistralConfig(**small, head_dim=32, sliding_window=4096)),
        "qwen2": _save(tmp, "qwen2", Qwen2Config(**small, tie_word_embeddings=True)),
        "mixtral": _save(tmp, "mixtral", MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)),
        "gpt2": _save(tmp, "gpt2", GPT2Config(n_embd=64, n_head=4, n_layer=3, vocab_size=300, n_positions=64)),
    }


def test_each_architecture_maps_to_megatron_names(folders):
    llama = hf_config(folders["llama"])
    assert (llama.num_layers, llama.hidden_size, llama.num_attention_heads, llama.num_query_groups,
            llama.ffn_hidden_size, llama.vocab_size, llama.max_position_embeddings) == (2, 64, 4, 2, 96, 300, 256)
    assert (llama.normalization, llama.activation, llama.gated_linear_unit, llama.position_embedding_type) == \
        ("RMSNorm", "silu", True, "rope")
    assert (llama.rotary_base, llama.rope_scaling, llama.rope_scaling_factor) == (500000, True, 32.0)
    assert not llama.add_bias_linear and not llama.add_qkv_bias and not llama.share_embeddings_and_output_weights
    assert llama.seq_length == 256 and llama.name == "llama"

    mistral = hf_config(folders["mistral"])
    assert mistral.kv_channels == 32 and mistral.head_dim == 32 and not mistral.rope_scaling

    qwen2 = hf_config(folders["qwen2"])
    assert qwen2.add_qkv_bias and not qwen2.add_bias_linear and qwen2.share_embeddings_and_output_weights

    mixtral = hf_config(folders["mixtral"])
    assert (mixtral.num_moe_experts, mixtral.moe_router_topk, mixtral.moe_ffn) == (4, 2, 96)

    gpt2 = hf_config(folders["gpt2"])
    assert (gpt2.normalization, gpt2.activation, gpt2.position_embedding_type, gpt2.ffn) == \
        ("LayerNorm", "gelu_tanh", "learned_absolute", 256)
    assert gpt2.add_bias_linear and gpt2.share_embeddings_and_output_weights and gpt2.max_position_embeddings == 64

    # overrides with mnb.gpt's names; the module is callable as the public function too
    import mnb.hf_config as module

    short = mnb.hf_config(folders["llama"], num_layers=1, seq_length=64)
    assert (short.num_layers, short.seq_length) == (1, 64) and module(folders["llama"]).num_layers == 2
    assert mnb.hf_config(folders["llama"] + "/config.json") == llama


def test_written_config_reads_back_the_same_model(folders, tmp_path):
    for name in ("llama", "qwen2", "mixtral", "gpt2"):
        cfg = hf_config(folders[name])
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps(to_hf_config(cfg)))
        assert hf_config(out) == cfg.with_overrides(name=name), name
    with pytest.raises(ValueError, match="matches none of LlamaForCausalLM"):
        to_hf_config(mnb.ModelConfig(normalization="RMSNorm", activation="gelu"))


def test_bad_configs_name_the_file_and_setting(folders, tmp_path):
    with pytest.raises(ValueError, match=r"nothere does not exist"):
        hf_config(tmp_path / "nothere")
    with pytest.raises(ValueError, match=r"empty/config.json does not exist"):
        (tmp_path / "empty").mkdir()
        hf_config(tmp_path / "empty")
    bad = tmp_path / "bert"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ValueError, match="architecture BertForMaskedLM is not supported; mnb.from_hf reads "
                                         + ", ".join(ARCHITECTURES)):
        hf_config(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="bert/config.json is not readable JSON"):
        hf_config(bad)
    yarn = _edit(folders["qwen2"], rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    with pytest.raises(ValueError, match="qwen2/config.json: RoPE scaling type 'yarn' cannot be expressed"):
        hf_config(yarn)
    odd = _edit(folders["llama"], rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                                     "high_freq_factor": 4.0, "rope_theta": 5e5})
    with pytest.raises(ValueError, match="low_freq_factor=2.0 cannot be expressed"):
        hf_config(odd)
    with pytest.raises(ValueError, match=r"mistral/config.json: seq_length\(8192\) exceeds sliding_window\(4096\): "
                                         r"Megatron's local attention has no sliding window.*pass seq_length<=4096"):
        hf_config(folders["mistral"], seq_length=8192)
    missing = _edit(folders["mixtral"], num_local_experts=None)
    with pytest.raises(ValueError, match="mixtral/config.json: MixtralForCausalLM needs the setting .num_local_experts. as a positive integer, got None"):
        hf_config(missing)
    with pytest.raises(ValueError, match=r"gpt2/config.json: num_attention_heads\(4\) is not divisible by "
                                         r"num_query_groups\(3\)"):
        hf_config(folders["gpt2"], num_query_groups=3)
    assert hf_config(folders["mistral"]).sliding_window == 4096  # recorded: logits and generate stop at it
    windowed = hf_config(_edit(folders["mistral"], sliding_window=8))  # seq_length defaults to the window
    assert (windowed.sliding_window, windowed.seq_length) == (8, 8)
    top1 = _edit(folders["mixtral"], num_local_experts=4, num_experts_per_tok=1)
    with pytest.raises(ValueError, match=r"mixtral/config.json: num_experts_per_tok=1: transformers' Mixtral weights"):
        hf_config(top1)
