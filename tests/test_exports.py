"""``%mnb export`` / ``mnb.export``: the notebook's layout and settings as a Megatron-LM launch.

Megatron-LM's own argument parser (``megatron.training.arguments``, shipped by
megatron-core 0.19 on Python 3.12: CI's second leg) reads the exported arguments
and its ``validate_args`` derives the same data-parallel size, virtual stages and
batch split as the notebook.  No pool is started here.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import mnb
from mnb.config import FSDP_STRATEGIES, ParallelConfig, TrainConfig, load_preset, model_config, uneven_pipeline_layout
from mnb.controller import registry
from mnb.controller.preflight import cell_settings
from mnb.megatron_lm.exports import export


def pairs(args) -> dict[str, str | None]:
    """``--flag value`` / ``--flag`` -> {flag: value or None}."""
    out: dict[str, str | None] = {}
    for i, word in enumerate(args):
        if word.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[word] = None if nxt is None or nxt.startswith("--") else nxt
    return out


LLAMA = dict(model="llama-1b", nodes=2, gpus_per_node=8, micro_batch_size=2, global_batch_size=64, bf16=True,
             recompute="selective", use_distributed_optimizer=True, warmup_steps=2, lr_decay_style="cosine",
             steps=50, layout=ParallelConfig(tp=2, pp=2, vpp=2, sequence_parallel=True))


@pytest.fixture(autouse=True)
def fresh_notebook(monkeypatch):
    """No training run or remembered mnb.gpt/mnb.train call from earlier tests in this process:
    settings a test does not name would otherwise come from them (as they do in a notebook)."""
    monkeypatch.setattr(registry, "_LAST_RUN", [])
    monkeypatch.setattr(registry, "_SETTINGS", {})


def test_the_exported_schedule_is_the_whole_schedule():
    """A notebook that trained 5 steps of a 10-step schedule exports the 10-step run; naming steps resets it."""
    train = TrainConfig(steps=5, schedule_steps=10, warmup_steps=2, lr_decay_style="cosine").to_dict()
    got = pairs(export("megatron-lm", model="tiny", nodes=1, gpus_per_node=2, train=train).args)
    assert (got["--train-iters"], got["--lr-decay-iters"], got["--lr-warmup-iters"]) == ("10", "10", "2")
    got = pairs(export("megatron-lm", model="tiny", nodes=1, gpus_per_node=2, train=train, steps=30).args)
    assert (got["--train-iters"], got["--lr-decay-iters"]) == ("30", "30")
    with pytest.raises(ValueError, match=r"warmup_steps\(2\) must be smaller than the schedule's 2 steps"):
        export("megatron-lm", model="tiny", nodes=1, gpus_per_node=2, train=train, steps=2)


def test_megatron_lm_arguments_carry_the_model_layout_and_training():
    e = export("megatron-lm", **LLAMA)
    got = pairs(e.args)
    cfg = load_preset("llama-1b")
    expected = {
        "--num-layers": "16", "--hidden-size": "2048", "--ffn-hidden-size": "8192", "--num-attention-heads": "32",
        "--num-query-groups": "8", "--seq-length": str(cfg.seq_length), "--rotary-base": "500000",
        "--normalization": "RMSNorm", "--vocab-size": "128256", "--tensor-model-parallel-size": "2",
        "--pipeline-model-parallel-size": "2", "--num-layers-per-virtual-pipeline-stage": "4",
        "--context-parallel-size": "1", "--micro-batch-size": "2", "--global-batch-size": "64",
        "--train-iters": "50", "--lr-warmup-iters": "2", "--lr-decay-style": "cosine",
        "--recompute-granularity": "selective", "--hidden-dropout": "0.0",
    }
    assert {k: got.get(k) for k in expected} == expected
    for flag in ("--swiglu", "--group-query-attention", "--sequence-parallel", "--bf16", "--disable-bias-linear",
                 "--use-distributed-optimizer", "--untie-embeddings-and-output-weights", "--mock-data"):
        assert flag in got and got[flag] is None, flag
    assert e.layout.dp == 4 and e.world_size == 16
    assert e.text.startswith("# Megatron-LM pretrain_gpt.py") and "tp2 pp2 vpp2 dp4 sp" in e.text.splitlines()[0]
    assert shlex.split(e.text.replace("\\\n", " "), comments=True) == list(e.args)  # the text is the list


def test_a_batch_that_does_not_split_on_the_target_is_refused_with_the_numbers():
    with pytest.raises(ValueError) as err:
        export("slurm", model="tiny", nodes=2, gpus_per_node=8, micro_batch_size=4, global_batch_size=16)
    text = str(err.value)
    assert "global_batch_size(16)" in text and "micro_batch_size(4) * dp(16) = 64" in text
    assert "2 node(s) x 8 GPU(s) = world size 16" in text and "multiple of 64" in text
    with pytest.raises(ValueError, match=r"tp\(3\) \* pp\(1\) \* cp\(1\) = 3 does not divide world size 8"):
        export("megatron-lm", model="tiny", gpus_per_node=8, layout=ParallelConfig(tp=3))
    with pytest.raises(ValueError, match=r"num_attention_heads\(4\) is not divisible by tp\(8\)"):
        export("megatron-lm", model="tiny", gpus_per_node=8, layout=ParallelConfig(tp=8))
    with pytest.raises(TypeError, match="unknown settings"):
        export("megatron-lm", model="tiny", gpus_per_node=2, learning_rate=1)


def test_context_parallel_says_megatron_lm_needs_transformer_engine():
    e = export("megatron-lm", model="tiny", gpus_per_node=4, layout=ParallelConfig(cp=2))
    assert pairs(e.args)["--context-parallel-size"] == "2"
    assert any(line.startswith("#") and "Transformer Engine for cp > 1" in line for line in e.text.splitlines())


def test_torchrun_and_slurm_exports_are_valid_bash_with_the_arguments(tmp_path):
    one = export("torchrun", model="tiny", gpus_per_node=4)
    many = export("torchrun", model="tiny", nodes=2, gpus_per_node=4)
    script = export("slurm", model="moe-tiny", nodes=3, gpus_per_node=4, layout=ParallelConfig(ep=2),
                    sbatch_options=["--partition=gpu", "--time=1:00:00"], output=tmp_path / "train.sbatch")
    assert "torchrun --standalone --nproc-per-node=4" in one.text
    assert "--nnodes=2 --nproc-per-node=4" in many.text and "--rdzv-backend=c10d" in many.text
    text = (tmp_path / "train.sbatch").read_text()
    for line in ("#SBATCH --nodes=3", "#SBATCH --gpus-per-node=4", "#SBATCH --partition=gpu",
                 "#SBATCH --time=1:00:00", "--rdzv-endpoint=\"$HEAD_NODE:$RDZV_PORT\""):
        assert line in text
    assert "--num-experts 4" in text and "--expert-model-parallel-size 2" in text
    assert "@" + "args@" not in text and os.access(tmp_path / "train.sbatch", os.X_OK)
    for exported, body in ((one, one.text), (many, many.text), (script, text)):
        # bash reads it (syntax) and the ARGS array holds exactly the exported arguments
        probe = body.split("\ntorchrun")[0].split("\nsrun")[0] + '\nprintf "%s\\n" "${ARGS[@]}"\n'
        done = subprocess.run(["bash", "-c", probe.replace("$(scontrol", "$(echo")], capture_output=True, text=True,
                              env={**os.environ, "SLURM_JOB_NODELIST": "n1"})
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\n")[:-1] == list(exported.args)


def _connections_after(script: str) -> str:
    """CUDA_DEVICE_MAX_CONNECTIONS after bash ran a script's lines up to the launch, from a job that had it 1."""
    probe = script.split("\ntorchrun")[0].split("\nsrun")[0] + '\necho "${CUDA_DEVICE_MAX_CONNECTIONS-unset}"\n'
    done = subprocess.run(["bash", "-c", probe.replace("$(scontrol", "$(echo")], capture_output=True, text=True,
                          env={**os.environ, "SLURM_JOB_NODELIST": "n1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_fsdp_layout_exports_megatron_fsdp_and_unsets_cuda_connections(capsys):
    """Under --use-megatron-fsdp Megatron-LM asserts --ckpt-format fsdp_dtensor and CUDA_DEVICE_MAX_CONNECTIONS
    != 1, the opposite of what tp > 1 needs without FSDP: the scripts unset it only for an FSDP layout."""
    for strategy in FSDP_STRATEGIES:
        e = export("torchrun", model="tiny", gpus_per_node=4, layout=ParallelConfig(tp=2, fsdp=strategy))
        got = pairs(e.args)
        assert (got["--data-parallel-sharding-strategy"], got["--ckpt-format"]) == (strategy, "fsdp_dtensor")
        assert {"--use-megatron-fsdp", "--use-distributed-optimizer"} <= set(got)
        assert e.args.count("--use-distributed-optimizer") == 1
        assert ("--no-gradient-accumulation-fusion" in got) == (strategy != "optim")  # Megatron-LM warns for these
        assert f"fsdp:{strategy}" in e.text.splitlines()[0] and _connections_after(e.text) == "unset"
    slurm = export("slurm", model="moe-tiny", nodes=2, gpus_per_node=4,
                   layout=ParallelConfig(ep=2, fsdp="optim_grads"))
    assert "--data-parallel-sharding-strategy optim_grads" in slurm.text and _connections_after(slurm.text) == "unset"
    alone = export("megatron-lm", model="tiny", gpus_per_node=2, layout=ParallelConfig(tp=2, fsdp="optim_grads"))
    assert any("dp(1) * cp(1) = 1 on this target" in n for n in alone.notes)  # nothing to shard: said, not silent
    plain = export("slurm", model="tiny", nodes=2, gpus_per_node=4, layout=ParallelConfig(tp=2))
    assert _connections_after(plain.text) == "1"  # without FSDP, tp > 1 needs it 1
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    shell.run_line_magic("mnb", "export torchrun --model tiny --gpus-per-node 4 --tp 2 --fsdp")
    out = capsys.readouterr().out
    assert "--data-parallel-sharding-strategy optim_grads_params" in out
    assert "tp2 pp1 dp2 fsdp:optim_grads_params" in out
    with pytest.raises(UsageError, match=r"fsdp='optim_grads_params' does not combine with pp\(2\)"):
        shell.run_line_magic("mnb", "export --model tiny --gpus-per-node 4 --pp 2 --fsdp")


def test_settings_come_from_the_notebook_when_not_named(monkeypatch):
    monkeypatch.setattr(registry, "_SETTINGS", {})
    with pytest.raises(ValueError, match="no model to export"):
        export("megatron-lm", gpus_per_node=2)
    found = cell_settings("model = mnb.gpt('tiny', num_layers=8, fusions=False)\n"
                          "mnb.train(model, steps=7, micro_batch_size=2, global_batch_size=8, lr=1e-3)\n"
                          "mnb.train(model, steps=n)\n")  # not literal: not taken
    registry.remember_settings(**found)
    e = export("megatron-lm", gpus_per_node=2)
    got = pairs(e.args)
    assert (got["--num-layers"], got["--train-iters"], got["--global-batch-size"], got["--lr"]) == ("8", "7", "8",
                                                                                                    "0.001")
    assert "--fusions" not in got
    assert export("megatron-lm", gpus_per_node=2, steps=3).train == TrainConfig(**{**found["train"], "steps": 3})


def test_text_data_exports_the_bin_idx_the_ranks_read():
    """The ranks tokenized the notebook's text into a .bin/.idx (their record names it): Megatron-LM reads
    that prefix, not mock tokens; another data= named at export time has no such file."""
    model = model_config("tiny", vocab_size=512).to_dict()
    train = dict(data="stdlib", steps=5, micro_batch_size=2, global_batch_size=4, seed=7)
    registry.record_training([{"model": model, "train": train, "tokenizer": None, "steps": [],
                               "data_prefix": "/cache/corpora/stdlib-0123456789abcdef"}])
    e = export("torchrun", gpus_per_node=1)
    got = pairs(e.args)
    assert (got["--data-path"], got["--split"], got["--seed"]) == ("/cache/corpora/stdlib-0123456789abcdef",
                                                                   "100,0,0", "7")
    assert "--mock-data" not in got
    assert any("'stdlib' as its ranks tokenized it" in n and "byte tokenizer" in n for n in e.notes)
    assert "--mock-data" in pairs(export("megatron-lm", gpus_per_node=1, data="other-texts").args)
    registry.record_training([{"model": model, "train": {**train, "data": "mock"}, "steps": []}])
    assert "--data-path" not in pairs(export("megatron-lm", gpus_per_node=1).args)


def test_a_padded_vocabulary_is_named_as_a_difference_of_the_loss():
    """Megatron-LM's softmax counts the padding columns, the notebook's loss hides them: the export says so."""
    padded = export("megatron-lm", model=model_config("tiny", vocab_size=257), gpus_per_node=2,
                    layout=ParallelConfig(tp=2))
    assert any("pads the vocabulary to 512" in n and "255 padding" in n and "multiple of 256" in n
               for n in padded.notes), padded.notes
    exact = export("megatron-lm", model=model_config("tiny", vocab_size=512), gpus_per_node=1)
    assert not any("padding columns" in n for n in exact.notes)


def test_the_torchrun_script_passes_its_own_arguments_on(tmp_path):
    """``bash train.sh --transformer-impl local``: the script's arguments follow the exported ones."""
    script = export("torchrun", model="tiny", gpus_per_node=1, output=tmp_path / "train.sh")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (fake / "torchrun").chmod(0o755)
    done = subprocess.run(["bash", str(tmp_path / "train.sh"), "--transformer-impl", "local"], capture_output=True,
                          text=True, env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "MEGATRON_LM": "/m"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == ["--standalone", "--nproc-per-node=1", "/m/pretrain_gpt.py",
                                            *script.args, "--transformer-impl", "local"]


def test_megatron_lm_counts_its_samples_from_the_exported_arguments(monkeypatch):
    """pretrain() sizes its datasets before the first step (``train_iters // eval_interval`` even with
    --eval-iters 0): the exported arguments must get it there."""
    arguments = pytest.importorskip("megatron.training.arguments",
                                    reason="megatron.training ships with megatron-core >= 0.17 (Python 3.12)")
    from megatron.training import global_vars, training

    e = export("megatron-lm", model="tiny", gpus_per_node=1, steps=20, micro_batch_size=2, global_batch_size=8)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *e.args])
    args = arguments.parse_args()
    arguments.validate_args(args)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    assert training.get_train_valid_test_num_samples()[0] == 20 * 8


def test_export_magic_prints_writes_and_refuses(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(registry, "_SETTINGS", {})
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    shell.run_line_magic("mnb", "export --model tiny --gpus-per-node 2 --tp 2 --sp --gbs 8 --mbs 2")
    out = capsys.readouterr().out
    assert "--tensor-model-parallel-size 2 \\" in out and "--sequence-parallel \\" in out and "dp1" in out
    path = tmp_path / "job.sbatch"
    shell.run_line_magic("mnb", f"export slurm --model tiny --nodes 2 --gpus-per-node 4 -o {path} "
                                "--sbatch-arg=--qos=debug")
    assert f"sbatch {path}" in capsys.readouterr().out and "#SBATCH --qos=debug" in path.read_text()
    with pytest.raises(UsageError, match=r"micro_batch_size\(2\) \* dp\(8\) = 16"):
        shell.run_line_magic("mnb", "export --model tiny --nodes 2 --gpus-per-node 4 --mbs 2 --gbs 24")
    assert callable(mnb.export) and "export" in mnb.__all__


def test_export_takes_the_layout_flags_of_megatron_including_no_sp(capsys):
    """One layout argument group and one layout-from-flags for %%megatron and %mnb export: --no-sp is a
    layout flag in both (naming it sets the whole layout, sequence parallelism off)."""
    from mnb.magics import megatron_parser, requested_layout
    from mnb.magic_parsers import export_parser, layout_from_flags

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    capsys.readouterr()
    shell.run_line_magic("mnb", "export --model tiny --gpus-per-node 2 --tp 2 --no-sp --gbs 8 --mbs 2")
    out = capsys.readouterr().out
    assert "--tensor-model-parallel-size 2 \\" in out and "--sequence-parallel" not in out
    for line in ("--tp 2 --no-sp", "--no-sp", "--tp 2 --sp --fsdp optim", "--pp 2 --vpp 2 --cp 1 --ep 1"):
        exported = layout_from_flags(export_parser().parse_args(line.split()))
        cell = requested_layout(ParallelConfig(tp=2, sequence_parallel=True).resolve(4),
                                megatron_parser().parse_args(line.split()), 4)
        assert exported is not None and exported.resolve(4) == cell, line
    assert layout_from_flags(export_parser().parse_args([])) is None


def test_a_file_that_is_not_an_export_is_kept_unless_overwrite(tmp_path, capsys, monkeypatch):
    """``-o`` onto a user's own script is refused, naming it and ``--overwrite``; an earlier export is
    replaced without the flag; ``mnb.export(output=...)`` and ``Exported.save`` refuse alike."""
    from mnb.errors import OverwriteRefusedError

    monkeypatch.setattr(registry, "_SETTINGS", {})
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    mine = tmp_path / "train.sbatch"
    mine.write_text("#!/bin/bash\n# my own job\nsrun my_training.py\n")
    line = f"export slurm --model tiny --nodes 2 --gpus-per-node 4 -o {mine}"
    with pytest.raises(UsageError, match=r"%mnb export -o: .*train.sbatch exists \(45 bytes\) and is not an mnb "
                                         r"export.*--overwrite"):
        shell.run_line_magic("mnb", line)
    with pytest.raises(OverwriteRefusedError, match="overwrite=True"):
        export("slurm", model="tiny", gpus_per_node=4, output=mine)
    with pytest.raises(OverwriteRefusedError, match="overwrite=True"):
        export("torchrun", model="tiny", gpus_per_node=4).save(mine)
    with pytest.raises(OverwriteRefusedError, match="is a folder"):
        export("torchrun", model="tiny", gpus_per_node=4, output=tmp_path, overwrite=True)
    assert mine.read_text() == "#!/bin/bash\n# my own job\nsrun my_training.py\n"
    shell.run_line_magic("mnb", line + " --overwrite")
    assert "#SBATCH --nodes=2" in mine.read_text()
    shell.run_line_magic("mnb", line.replace("--nodes 2", "--nodes 3"))  # an earlier export: no flag needed
    assert "#SBATCH --nodes=3" in mine.read_text()
    assert f"wrote {mine}" in capsys.readouterr().out


def test_megatron_lms_own_parser_reads_the_same_values(monkeypatch, tmp_path):
    """Megatron-LM's parse_args + validate_args on the exported list, as rank 0 of the target world.

    Presets, and Hugging Face checkpoint folders (tests/hf_folders.py): their tokenizer, q/k/v
    biases, Llama 3's RoPE scaling, GPT-2's tanh GELU and learned positions, tied embeddings."""
    from hf_folders import checkpoint

    arguments = pytest.importorskip("megatron.training.arguments",
                                    reason="megatron.training ships with megatron-core >= 0.17 (Python 3.12)")
    # validate_args asks the GPU's architecture for tp > 1; the target is a Hopper cluster, not this host.
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    cases = [
        LLAMA,
        dict(model="moe-tiny", nodes=1, gpus_per_node=4, micro_batch_size=1, global_batch_size=8,
             recompute="full", layout=ParallelConfig(tp=2, ep=2, sequence_parallel=True)),
        dict(model="gpt2-124m", nodes=1, gpus_per_node=4, micro_batch_size=2, lr=6e-4, min_lr=6e-5,
             weight_decay=0.1, lr_decay_style="linear", warmup_steps=5, steps=20, schedule_steps=40,
             layout=ParallelConfig(cp=2)),
        dict(model=str(checkpoint(tmp_path, "Llama-3.2-1B", tokenizer_ids=128256)), nodes=1, gpus_per_node=8,
             micro_batch_size=1, global_batch_size=16, bf16=True, layout=ParallelConfig(tp=2, pp=2)),
        dict(model=str(checkpoint(tmp_path, "Qwen2.5-0.5B", tokenizer_ids=151665)), nodes=1, gpus_per_node=4,
             micro_batch_size=2, layout=ParallelConfig(tp=2, sequence_parallel=True)),
        dict(model=str(checkpoint(tmp_path, "gpt2")), nodes=1, gpus_per_node=2, micro_batch_size=4),
        # Megatron-FSDP, each sharding strategy (with tp and sp, with ep, without the distributed optimizer)
        dict(model="llama-1b", nodes=2, gpus_per_node=8, micro_batch_size=1, global_batch_size=32, bf16=True,
             layout=ParallelConfig(tp=2, sequence_parallel=True, fsdp="optim_grads_params")),
        dict(model="moe-tiny", nodes=1, gpus_per_node=4, micro_batch_size=1, global_batch_size=8,
             layout=ParallelConfig(ep=2, fsdp="optim_grads")),
        dict(model="tiny", nodes=1, gpus_per_node=2, micro_batch_size=2, use_distributed_optimizer=False,
             layout=ParallelConfig(fsdp="optim")),
        # uneven end stages: interleaved through Megatron-Core's layout, plain through the first/last counts
        dict(model=model_config("tiny", num_layers=6, pipeline_model_parallel_layout=uneven_pipeline_layout(
            6, 2, 2, first=3)), nodes=1, gpus_per_node=4, micro_batch_size=1, global_batch_size=8,
             layout=ParallelConfig(pp=2, vpp=2)),
        dict(model=model_config("tiny", num_layers=8, num_layers_in_first_pipeline_stage=2,
                                num_layers_in_last_pipeline_stage=2), nodes=1, gpus_per_node=3,
             micro_batch_size=1, global_batch_size=9, layout=ParallelConfig(pp=3, vpp=2)),
    ]
    for case in cases:
        e = export("megatron-lm", **case)
        monkeypatch.setenv("WORLD_SIZE", str(e.world_size))
        monkeypatch.setenv("RANK", "0")
        # CUDA_DEVICE_MAX_CONNECTIONS as the torchrun script leaves it (1, or unset under FSDP)
        connections = _connections_after(export("torchrun", **case).text)
        if connections == "unset":
            monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        else:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections)
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *e.args])
        args = arguments.parse_args()
        arguments.validate_args(args)
        m, t, lay = e.model, e.train, e.layout
        got = {k: getattr(args, k) for k in (
            "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
            "seq_length", "max_position_embeddings", "position_embedding_type", "normalization", "layernorm_epsilon",
            "swiglu", "add_bias_linear", "untie_embeddings_and_output_weights", "init_method_std", "vocab_size",
            "hidden_dropout", "attention_dropout", "num_experts", "moe_router_topk",
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "context_parallel_size", "expert_model_parallel_size", "sequence_parallel", "data_parallel_size",
            "micro_batch_size", "global_batch_size", "train_iters", "lr", "min_lr", "lr_decay_style",
            "lr_warmup_iters", "lr_decay_iters", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "bf16",
            "recompute_granularity", "use_distributed_optimizer", "seed", "calculate_per_token_loss",
            "tokenizer_type", "tokenizer_model", "add_qkv_bias", "use_rope_scaling", "rope_scaling_factor",
            "rotary_base", "openai_gelu", "use_megatron_fsdp", "data_parallel_sharding_strategy", "ckpt_format",
            "gradient_accumulation_fusion")}
        want = {
            "num_layers": m.num_layers, "hidden_size": m.hidden_size, "ffn_hidden_size": m.ffn,
            "num_attention_heads": m.num_attention_heads,
            "num_query_groups": m.query_groups if m.query_groups != m.num_attention_heads else 1,
            "seq_length": m.seq_length, "max_position_embeddings": m.max_position_embeddings,
            "position_embedding_type": m.position_embedding_type, "normalization": m.normalization,
            "layernorm_epsilon": m.layernorm_epsilon, "swiglu": m.gated_linear_unit,
            "add_bias_linear": m.add_bias_linear,
            "untie_embeddings_and_output_weights": not m.share_embeddings_and_output_weights,
            "init_method_std": m.init_method_std, "hidden_dropout": 0.0,
            # a checkpoint's own tokenizer sizes the vocabulary in Megatron-LM; NullTokenizer takes --vocab-size
            "vocab_size": None if e.tokenizer else m.vocab_size,
            "tokenizer_type": "HuggingFaceTokenizer" if e.tokenizer else "NullTokenizer",
            "tokenizer_model": e.tokenizer, "add_qkv_bias": m.add_bias_linear or m.add_qkv_bias,
            "use_rope_scaling": m.rope_scaling, "rope_scaling_factor": m.rope_scaling_factor,
            "rotary_base": m.rotary_base, "openai_gelu": m.activation == "gelu_tanh",
            "attention_dropout": 0.0, "num_experts": m.num_moe_experts,
            "moe_router_topk": m.moe_router_topk, "tensor_model_parallel_size": lay.tp,
            "pipeline_model_parallel_size": lay.pp,
            "virtual_pipeline_model_parallel_size": lay.vpp if (lay.vpp or 1) > 1 else None,
            "context_parallel_size": lay.cp, "expert_model_parallel_size": lay.ep,
            "sequence_parallel": lay.sequence_parallel and lay.tp > 1, "data_parallel_size": lay.dp,
            "micro_batch_size": t.micro_batch_size,
            "global_batch_size": t.global_batch_size or t.micro_batch_size * lay.dp, "train_iters": t.schedule_length,
            "lr": t.lr, "min_lr": t.min_lr, "lr_decay_style": t.lr_decay_style, "lr_warmup_iters": t.warmup_steps,
            "lr_decay_iters": max(t.schedule_length, t.warmup_steps + 1), "weight_decay": t.weight_decay,
            "clip_grad": t.clip_grad, "adam_beta1": t.adam_beta1, "adam_beta2": t.adam_beta2, "bf16": t.bf16,
            "recompute_granularity": None if t.recompute == "none" else t.recompute,
            "use_distributed_optimizer": t.use_distributed_optimizer or lay.fsdp is not None, "seed": t.seed,
            "calculate_per_token_loss": True, "use_megatron_fsdp": lay.fsdp is not None,
            "data_parallel_sharding_strategy": lay.fsdp or "optim_grads_params",  # Megatron-LM's default otherwise
            "ckpt_format": "fsdp_dtensor" if lay.fsdp else "torch_dist",
            "gradient_accumulation_fusion": lay.fsdp not in ("optim_grads", "optim_grads_params"),
        }
        assert got == want, {k: (got[k], want[k]) for k in want if got[k] != want[k]}
        assert args.pipeline_model_parallel_layout == m.extra.get("pipeline_model_parallel_layout")
        assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (
            m.extra.get("num_layers_in_first_pipeline_stage"), m.extra.get("num_layers_in_last_pipeline_stage"))



def test_an_fp8_model_exports_transformer_engines_nearest_recipe(capsys, monkeypatch):
    """mnb.gpt(..., fp8='tensorwise') is TE's per-tensor current scaling (--fp8-recipe tensorwise, hybrid: E5M2
    gradients); rowwise has no TE recipe and exports the nearest (blockwise, E4M3) with a note saying so;
    the notebook's last model carries it (the ranks' reply), and %mnb export --fp8 names it."""
    tw = export("megatron-lm", model="llama-1b", fp8="tensorwise", nodes=1, gpus_per_node=8, bf16=True)
    flags = pairs(tw.args)
    assert flags["--fp8-format"] == "hybrid" and flags["--fp8-recipe"] == "tensorwise" and "--bf16" in flags
    assert any("current (per-tensor) scaling" in n for n in tw.notes)
    rw = export("megatron-lm", model="llama-1b", fp8="rowwise", nodes=1, gpus_per_node=8, bf16=True)
    assert pairs(rw.args)["--fp8-recipe"] == "blockwise" and pairs(rw.args)["--fp8-format"] == "e4m3"
    assert any("no row-wise recipe" in n for n in rw.notes)
    dl = pairs(export("megatron-lm", model="llama-1b", fp8="delayed", nodes=1, gpus_per_node=8, bf16=True).args)
    assert (dl["--fp8-format"], dl["--fp8-recipe"], dl["--fp8-amax-compute-algo"]) == ("hybrid", "delayed", "max")
    assert dl["--fp8-amax-history-len"] == "16"
    assert "--fp8-format" not in pairs(export("megatron-lm", model="llama-1b", nodes=1, gpus_per_node=8).args)
    # the last mnb.gpt of the notebook, as the ranks reported it
    monkeypatch.setattr(registry, "_SETTINGS", {"model": {**load_preset("llama-1b").to_dict(), "fp8": "rowwise"},
                                                "train": {"bf16": True}})
    assert pairs(export("megatron-lm", nodes=1, gpus_per_node=8).args)["--fp8-recipe"] == "blockwise"
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    shell.run_line_magic("mnb", "export --model llama-1b --gpus-per-node 8 --fp8 tensorwise")
    assert "--fp8-recipe tensorwise" in capsys.readouterr().out
    with pytest.raises(UsageError, match="'tensorwise', 'rowwise'"):
        shell.run_line_magic("mnb", "export --model llama-1b --gpus-per-node 8 --fp8 hybird")


def test_megatron_lm_reads_the_fp8_arguments(monkeypatch):
    arguments = pytest.importorskip("megatron.training.arguments",
                                    reason="megatron.training ships with megatron-core >= 0.17 (Python 3.12)")
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    for recipe, fmt in (("tensorwise", "hybrid"), ("rowwise", "e4m3"), ("delayed", "hybrid")):
        e = export("megatron-lm", model="llama-1b", fp8=recipe, nodes=1, gpus_per_node=8, bf16=True)
        monkeypatch.setenv("WORLD_SIZE", "8")
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *e.args])
        args = arguments.parse_args()
        arguments.validate_args(args)
        assert args.fp8 == fmt and args.fp8_recipe == pairs(e.args)["--fp8-recipe"]
        if recipe == "delayed":
            assert (args.fp8_amax_history_len, args.fp8_amax_compute_algo) == (16, "max")


def test_an_interleaved_layout_with_a_short_last_group_of_microbatches_is_refused():
    """Megatron-LM's interleaved schedule refuses 8 microbatches on pp 3 at its first step: the export says so
    before writing a launch that would fail on the cluster."""
    with pytest.raises(ValueError, match=r"num_microbatches\(8\) is not a multiple of 3 \(Megatron-Core refuses it\) "
                                         r"on 1 node\(s\) x 3 GPU\(s\)"):
        export("megatron-lm", model=model_config("tiny", num_layers=6), nodes=1, gpus_per_node=3, micro_batch_size=1,
               global_batch_size=8, layout=ParallelConfig(pp=3, vpp=2))
