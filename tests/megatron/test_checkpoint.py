"""mnb.megatron.checkpoint on real gloo ranks (CPU): round trip, resharding, atomicity.

    python -m pytest tests/megatron/test_checkpoint.py -q

Each test starts fresh rank processes: this file run as a script
(``python test_checkpoint.py FUNCTION OUTDIR``) with torchrun's environment
variables on 127.0.0.1; a rank calls ``mnb.megatron.cpu.install()``,
``init_process_group("gloo")`` and the named function.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SEQ, MBS, MICROBATCHES = 32, 2, 2


# -- launcher (parent side) --------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(fn: str, world: int, out: Path, cache: Path, **kwargs) -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "kwargs.json").write_text(json.dumps(kwargs))
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MNB_CACHE=str(cache),
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        log = open(out / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, __file__, fn, str(out)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        log.close()
    return procs


def _wait(procs, out: Path, timeout_s: float = 240) -> list:
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2)  # let the others report their own error
                break
            time.sleep(0.05)
    finally:
        _kill(procs)
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        logs = "\n".join(f"--- rank {r} ---\n" + (out / f"rank{r}.log").read_text()[-3000:]
                         for r in failed)
        raise RuntimeError(f"ranks {failed} failed:\n{logs}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(procs))]


def _kill(procs) -> None:
    for p in procs:  # only the processes this test started, by pid
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()


def _run(fn: str, world: int, tmp_path: Path, **kwargs) -> list:
    out = tmp_path / f"{fn}-{time.monotonic_ns()}"
    return _wait(_start(fn, world, out, tmp_path / "cache", **kwargs), out)


# -- rank side: a small GPT trained with Megatron's schedule, DDP and optimizer ---------


class Model:
    """What the checkpoint module reads from an mnb model: chunks, optimizer, config."""

    def __init__(self, chunks, optimizer, config):
        from mnb.megatron.data import dataset_for

        self.chunks, self.optimizer, self.config, self.step = chunks, optimizer, config, 0
        # Collective (Megatron's builder barriers): build it on every rank, outside the schedule.
        self.dataset = dataset_for("stdlib-small", config, SEQ, 64, seed=5)


def build(tp: int, pp: int, seed: int = 1234) -> Model:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from mnb.config import ParallelConfig, model_config
    from mnb.megatron.layout import apply_layout

    apply_layout(ParallelConfig(tp=tp, pp=pp), seed=seed)
    mc = model_config("tiny", vocab_size=257, seq_length=SEQ, num_layers=2)
    cfg = TransformerConfig(
        num_layers=mc.num_layers, hidden_size=mc.hidden_size,
        num_attention_heads=mc.num_attention_heads, ffn_hidden_size=mc.ffn,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02)
    # The same padded vocabulary under every layout: padding rows are real logits
    # (trained through the softmax), so a tp-dependent padding (128 * tp: 384 at
    # tp=1, 512 at tp=2) changes the loss after resharding by itself (~0.14 here).
    vocab = 512
    module = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=vocab,
                      max_sequence_length=mc.max_position_embeddings,
                      pre_process=ps.is_pipeline_first_stage(),
                      post_process=ps.is_pipeline_last_stage(),
                      share_embeddings_and_output_weights=False)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), module)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0), [ddp])
    return Model([ddp], opt, mc)


def batches(model: Model, step: int):
    ds = model.dataset
    first = step * MBS * MICROBATCHES
    for m in range(MICROBATCHES):
        items = [ds[first + m * MBS + i] for i in range(MBS)]
        yield {k: __import__("torch").stack([it[k] for it in items]) for k in items[0]}


def train_step(model: Model) -> float | None:
    """One optimizer step; the mean loss on the last pipeline stage (None elsewhere)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        out = chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_fn(output):
            mask = batch["loss_mask"]
            loss = (output.float() * mask).sum() / mask.sum()
            return loss, {"lm loss": loss.detach()}

        return out, loss_fn

    for chunk in model.chunks:
        chunk.zero_grad_buffer()
    model.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=batches(model, model.step),
        model=model.chunks, num_microbatches=MICROBATCHES, seq_length=SEQ,
        micro_batch_size=MBS, decoder_seq_length=SEQ, forward_only=False)
    ok, _, _ = model.optimizer.step()
    assert ok
    model.step += 1
    if ps.is_pipeline_last_stage():
        return float(torch.stack([d["lm loss"] for d in losses]).mean())
    return None


def snapshot(model: Model) -> dict:
    """Copies of every parameter and optimizer-state tensor on this rank."""
    params = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(model.chunks)
              for n, p in c.named_parameters()}
    state = model.optimizer.state_dict()
    return {"params": params, "opt": _tensors(state)}


def _tensors(obj, prefix="") -> dict:
    import torch

    if isinstance(obj, torch.Tensor):
        return {prefix: obj.detach().clone()}
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _tensors(val, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in _tensors(val, f"{prefix}/{i}").items()}
    return {}


def differences(a: dict, b: dict) -> list[str]:
    import torch

    bad = []
    for part in ("params", "opt"):
        if a[part].keys() != b[part].keys():
            bad.append(f"{part} keys differ")
        bad += [f"{part}:{k}" for k in a[part] if k in b[part] and not torch.equal(a[part][k], b[part][k])]
    return bad


def scramble(model: Model) -> None:
    import torch

    with torch.no_grad():
        for chunk in model.chunks:
            for p in chunk.parameters():
                p.add_(1.0)
    model.optimizer.reload_model_params()
    model.step = -1


def rank_round_trip(path: str) -> dict:
    from mnb.megatron import checkpoint

    model = build(tp=2, pp=1)
    train_step(model)
    train_step(model)
    checkpoint.save(path, model, extra={"consumed_samples": 8})
    saved = snapshot(model)
    scramble(model)
    assert differences(saved, snapshot(model))  # the scramble changed something
    info = checkpoint.load(path, model)
    return {"diff": differences(saved, snapshot(model)), "step": model.step,
            "info": {k: info[k] for k in ("step", "optimizer_loaded", "rng_loaded", "extra")},
            "files": sorted(os.listdir(Path(path).parent))}


def rank_train_and_save(path: str, steps: int, extra_steps: int) -> dict:
    from mnb.megatron import checkpoint

    model = build(tp=2, pp=1)
    for _ in range(steps):
        train_step(model)
    checkpoint.save(path, model)
    return {"next_losses": [train_step(model) for _ in range(extra_steps)]}


def rank_load_and_continue(path: str, tp: int, pp: int, extra_steps: int) -> dict:
    from mnb.megatron import checkpoint

    model = build(tp=tp, pp=pp, seed=999)  # different init: everything must come from the file
    info = checkpoint.load(path, model)
    assert model.step == info["step"]
    return {"next_losses": [train_step(model) for _ in range(extra_steps)],
            "optimizer_loaded": info["optimizer_loaded"], "rng_loaded": info["rng_loaded"]}


def rank_save_then_fail(path: str, mode: str) -> dict:
    import torch
    from megatron.core import dist_checkpointing

    from mnb.megatron import checkpoint

    model = build(tp=2, pp=1)
    train_step(model)
    checkpoint.save(path, model)
    good = snapshot(model)
    torch.save(good, Path(path).parent / f"good-rank{torch.distributed.get_rank()}.pt")
    train_step(model)
    real_save = dist_checkpointing.save

    def partial_save(state, directory, *args, **kwargs):
        real_save(state, directory, *args, **kwargs)  # tensors written, no mnb.json, no rename
        (Path(directory) / f"partial-{torch.distributed.get_rank()}").write_text("x")
        if mode == "raise":
            raise OSError("disk full (simulated)")
        (Path(path).parent / "save-started").touch()
        time.sleep(600)  # the test kills the ranks here

    dist_checkpointing.save = partial_save
    try:
        checkpoint.save(path, model)
    except OSError:
        pass
    else:
        raise AssertionError("save should have failed")
    finally:
        dist_checkpointing.save = real_save
    scramble(model)
    info = checkpoint.load(path, model)
    return {"diff": differences(good, snapshot(model)), "step": info["step"]}


def rank_load_good(path: str) -> dict:
    import torch

    from mnb.megatron import checkpoint

    model = build(tp=2, pp=1, seed=4321)
    info = checkpoint.load(path, model)
    good = torch.load(Path(path).parent / f"good-rank{torch.distributed.get_rank()}.pt")
    return {"diff": differences(good, snapshot(model)), "step": info["step"]}


# -- tests (parent side) -----------------------------------------------------------------


def test_round_trip_is_bitwise(tmp_path):
    results = _run("rank_round_trip", 2, tmp_path, path=str(tmp_path / "ckpt" / "a"))
    for r in results:
        assert r["diff"] == []
        assert r["step"] == 2
        assert r["info"] == {"step": 2, "optimizer_loaded": True, "rng_loaded": True,
                             "extra": {"consumed_samples": 8}}
        assert r["files"] == ["a"]  # no .tmp-/.old- leftovers


@pytest.mark.slow
def test_resume_in_another_layout_continues_the_loss(tmp_path):
    """Save at tp=2 after 2 steps, load at pp=2: the next 2 losses equal the uninterrupted run's."""
    path = str(tmp_path / "ckpt" / "run")
    straight = _run("rank_train_and_save", 2, tmp_path, path=path, steps=2, extra_steps=2)
    resumed = _run("rank_load_and_continue", 2, tmp_path, path=path, tp=1, pp=2, extra_steps=2)
    expected = straight[-1]["next_losses"]
    got = resumed[-1]["next_losses"]  # last pipeline stage holds the loss
    assert resumed[0]["next_losses"] == [None, None]
    assert all(r["optimizer_loaded"] and not r["rng_loaded"] for r in resumed)
    assert got == pytest.approx(expected, abs=1e-5), (got, expected)


@pytest.mark.slow
def test_failed_save_keeps_the_last_checkpoint(tmp_path):
    path = tmp_path / "ckpt" / "run"
    for r in _run("rank_save_then_fail", 2, tmp_path, path=str(path), mode="raise"):
        assert r["diff"] == [] and r["step"] == 1


@pytest.mark.slow
def test_killed_save_keeps_the_last_checkpoint(tmp_path):
    path = tmp_path / "ckpt" / "run"
    out = tmp_path / "killed"
    procs = _start("rank_save_then_fail", 2, out, tmp_path / "cache", path=str(path), mode="hang")
    deadline = time.monotonic() + 240
    while not (path.parent / "save-started").exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
            (out / "rank0.log").read_text()[-3000:])
        time.sleep(0.1)
    _kill(procs)  # mid-save: new tensors written into run.tmp-*, nothing renamed
    assert list(path.parent.glob("run.tmp-*"))
    for r in _run("rank_load_good", 2, tmp_path, path=str(path)):
        assert r["diff"] == [] and r["step"] == 1


def test_find_checkpoint_after_a_crash_between_renames(tmp_path):
    from mnb.megatron.checkpoint import find_checkpoint

    def fake(name, t):
        d = tmp_path / name
        d.mkdir()
        (d / "metadata.json").write_text("{}")
        (d / "mnb.json").write_text(json.dumps({"step": t, "time": t}))
        return d

    old = fake("run.old-aaa", 1)
    assert find_checkpoint(tmp_path / "run") == old
    new = fake("run.tmp-bbb", 2)
    (tmp_path / "run.tmp-ccc").mkdir()  # an incomplete save: ignored
    assert find_checkpoint(tmp_path / "run") == new
    current = fake("run", 3)
    assert find_checkpoint(tmp_path / "run") == current


# -- rank entry point ------------------------------------------------------------------


def _rank_entry() -> None:
    fn, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    try:
        import torch

        torch.set_num_threads(1)
        try:
            from mnb.megatron import cpu

            cpu.install()
        except ImportError:
            pass
        torch.distributed.init_process_group("gloo")
        result = globals()[fn](**json.loads((out / "kwargs.json").read_text()))
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        torch.distributed.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _rank_entry()
