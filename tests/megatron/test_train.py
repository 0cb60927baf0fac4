"""mnb.train: run records, events, continued training, errors."""

import pytest
from conftest import ok

from mnb.config import ModelConfig, TrainConfig
from mnb.megatron.model import padded_vocab_size
from mnb.megatron.record import model_flops_per_step
from mnb.megatron.train import train_config

STEP_KEYS = {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s",
             "mem_allocated_bytes", "mem_peak_bytes", "mem_reserved_bytes"}
ROW_KEYS = {"step", "stage", "chunk", "kind", "microbatch", "start_s", "end_s", "origin_s"}


@pytest.mark.slow
def test_run_record_schema(world1, world2):
    record = ok(world1["events"])["record"]
    for key in ("rank", "world_size", "coords", "layout", "model", "train", "device", "device_name",
                "num_microbatches", "num_parameters_local", "model_flops_per_step", "steps",
                "timeline", "memory", "memory_source", "memory_components"):
        assert key in record, key
    assert set(record["memory_components"]) == {"weights", "gradients", "optimizer", "activations",
                                                "activations_per_microbatch", "peak", "peak_source"}
    assert record["memory_components"]["peak_source"] == "counted tensors"
    assert record["device"] == "cpu" and record["memory_source"] == "rss"
    assert set(record["coords"]) == {"tp", "pp", "dp", "cp", "ep"}
    assert record["layout"]["dp"] == 1 and record["train"]["steps"] == 2
    assert record["model"] == ModelConfig(**{**record["model"]}).to_dict()
    assert all(set(row) == STEP_KEYS for row in record["steps"])
    assert all(set(row) == ROW_KEYS for row in record["timeline"])
    assert record["memory"]["capacity_bytes"] is None
    assert record["memory"]["peak_allocated_bytes"] > 0
    tp2 = ok(world2[1]["tp2"])
    assert tp2["rank"] == 1 and tp2["world_size"] == 2 and tp2["coords"]["tp"] == 1
    assert tp2["num_parameters_local"] < ok(world1["events"])["record"]["num_parameters_local"] * 2


@pytest.mark.slow
def test_progress_events_and_published_record(world1):
    events = ok(world1["events"])
    assert events["kinds"] == ["progress", "progress", "run_record"]
    assert [p["step"] for p in events["progress"]] == [1, 2]
    assert all(p["steps"] == 2 and p["loss"] > 0 and p["tokens_per_s"] > 0 for p in events["progress"])
    assert events["taken"] == 1 and events["taken_is_record"]


@pytest.mark.slow
def test_second_train_call_continues(world1):
    result = ok(world1["continue"])
    assert result["split"] == result["once"]
    assert result["second_steps"] == [4, 5, 6]  # steps 1-3, then 4-6: numbered from 1, going on
    # the record reads as before and shows as one line (a cell's last value)
    assert result["type"] == "TrainResult" and result["losses_key"] == result["split"][3:]
    assert result["lrs"] == [1e-3] * 3
    line = result["repr"]
    assert "\n" not in line and line.startswith("<mnb.train rank 0 (tp0 pp0 dp0): 3 steps (4-6), loss ")
    assert "tokens/s" in line and "peak" in line and len(line) < 160


@pytest.mark.slow
def test_out_of_memory_message(world1):
    result = ok(world1["oom"])
    assert result["type"] == "OutOfMemoryError" and result["cause"] == "OutOfMemoryError"
    message = result["message"]
    for part in ("rank 0", "pipeline stage 0 of 1", "ran out of memory at step 1", "allocated",
                 "peak", "(rss)", "micro_batch_size", "Tried to allocate 20.00 GiB"):
        assert part in message, part


def test_unknown_train_setting_is_named():
    with pytest.raises(TypeError, match="learning_rate"):
        train_config(learning_rate=1.0)
    assert train_config(steps=3) == TrainConfig(steps=3)


def test_vocab_padding_like_megatron():
    assert padded_vocab_size(256, 1) == 256
    assert padded_vocab_size(257, 1) == 384
    assert padded_vocab_size(257, 2) == 512
    assert padded_vocab_size(50257, 8) == 51200


def test_model_flops_formula():
    cfg = ModelConfig(
        num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257,
        max_position_embeddings=1024, seq_length=1024)
    b, s, h, L, V = 8, 1024, 768, 12, 50304
    expected = 12 * b * s * L * h * h * ((1 + 1 + s / h) + 4) + 6 * b * s * h * V
    assert model_flops_per_step(cfg, b, V) == pytest.approx(expected)
    # Without attention and logits terms this is 6 * tokens * transformer weights.
    dense = 12 * b * s * L * h * h * (2 + 4)
    assert dense == pytest.approx(6 * b * s * L * 12 * h * h)
