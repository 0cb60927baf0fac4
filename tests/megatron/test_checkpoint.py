"""mnb.megatron.checkpoint on real gloo ranks (CPU): round trip, resharding, atomicity.

    python -m pytest tests/megatron/test_checkpoint.py -q

The ranks are ``tests/megatron/ranks.py``'s (``run_ranks``: ``cpu.install()``,
``init_process_group("gloo")``, then a function of this file).  Three launches serve the
file: one runs every scenario in turn (``rank_scenarios``: each on its own folder, its result
or its traceback kept apart from the others'), one is killed in the middle of a save (a
process must die), one runs without mnb's CPU mode (a process cannot leave it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest import ok  # noqa: E402
from ranks import run_ranks, start_ranks  # noqa: E402


def _group_alive(group: int, wait_s: float = 5.0) -> bool:
    """Whether any process is left in process group ``group`` after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    return True


# -- rank side: mnb.gpt + mnb.train (Megatron schedule, DDP, optimizer) -------------


def build(tp: int, pp: int, seed: int = 1234, **overrides):
    from mnb.config import ParallelConfig
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt

    apply_layout(ParallelConfig(tp=tp, pp=pp))
    # tiny: vocab_size 512, so the padded vocabulary (128 * tp multiple) is the same
    # for tp 1, 2, 4; padding rows are real logits, so a layout-dependent padding
    # alone would change the loss after resharding.
    return gpt("tiny", seed=seed, **overrides)


def train(model, steps: int, **kwargs) -> list[float]:
    from mnb.megatron.train import train as mnb_train

    settings = dict(micro_batch_size=2, global_batch_size=4, lr=3e-3, data="stdlib-small")
    record = mnb_train(model, steps=steps, **{**settings, **kwargs})
    return [row["loss"] for row in record["steps"]]


def snapshot(model) -> dict:
    """Copies of every parameter and optimizer-state tensor on this rank."""
    params = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(model.chunks)
              for n, p in c.named_parameters()}
    opt = _tensors(model.optimizer.state_dict()) if model.optimizer is not None else {}
    return {"params": params, "opt": opt}


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


def scramble(model) -> None:
    import torch

    with torch.no_grad():
        for chunk in model.chunks:
            for p in chunk.parameters():
                p.add_(1.0)
    if model.optimizer is not None:
        model.optimizer.reload_model_params()
        for state in model.optimizer.state_dict()["state"].values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.add_(1.0)
    model.steps_done, model.consumed_samples = -1, -1


def rank_round_trip(path: str) -> dict:
    from mnb.megatron import checkpoint

    model = build(tp=2, pp=1)
    train(model, 2)
    checkpoint.save(path, model, extra={"note": "after 2 steps"})
    saved = snapshot(model)
    scramble(model)
    assert differences(saved, snapshot(model))  # the scramble changed something
    info = checkpoint.load(path, model)
    return {"diff": differences(saved, snapshot(model)),
            "progress": [model.steps_done, model.consumed_samples],
            "info": {k: info[k] for k in ("step", "optimizer_loaded", "rng_loaded", "extra")},
            "files": sorted(os.listdir(Path(path).parent)),
            "users": users_files_and_crash(Path(path), model)}


def _users_files(folder: Path) -> None:
    import torch

    if torch.distributed.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "notes.txt").write_text("mine")
        (folder / "sub").mkdir()
        (folder / "sub" / "data.csv").write_text("1,2")
    torch.distributed.barrier()


def _listing(folder: Path) -> dict:
    """Every entry under ``folder``'s parent that is ``folder`` or its siblings, and the user's files' text."""
    return {"siblings": sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(folder.name)),
            "notes": (folder / "notes.txt").read_text() if (folder / "notes.txt").exists() else None,
            "data": (folder / "sub" / "data.csv").read_text() if (folder / "sub" / "data.csv").exists() else None}


def users_files_and_crash(path: Path, model) -> dict:
    """A user's notes.txt and sub/ in a checkpoint folder survive the next save; a folder of theirs is
    refused (the same on every rank) and, with overwrite=True, keeps them; a save stopped between its
    two renames is read by the next load and finished by the next save."""
    import torch

    from mnb.errors import OverwriteRefusedError
    from mnb.megatron import checkpoint

    out: dict = {}
    _users_files(path)
    checkpoint.save(path, model, extra={"which": "second"})
    out["resaved"] = _listing(path)
    theirs = path.with_name("theirs")
    _users_files(theirs)
    try:
        checkpoint.save(theirs, model)
        out["refused"] = None
    except OverwriteRefusedError as exc:
        out["refused"] = str(exc)
    out["after_refusal"] = _listing(theirs) | {"entries": sorted(os.listdir(theirs))}
    torch.distributed.barrier()  # rank 0's next save may create theirs.tmp-ID before its first collective
    checkpoint.save(theirs, model, overwrite=True, extra={"which": "theirs"})  # the ranks are still in step
    out["overwritten"] = _listing(theirs) | {"extra": checkpoint.load(theirs, model)["extra"]}
    # a save stopped between its renames: the new checkpoint complete in path.tmp-<id>, the old one moved aside
    newer = path.with_name("newer")
    checkpoint.save(newer, model, extra={"which": "newer"})
    if torch.distributed.get_rank() == 0:
        os.replace(newer, path.with_name(f"{path.name}.tmp-crashed"))
        os.replace(path, path.with_name(f"{path.name}.old-crashed"))  # the first rename; the second never came
    torch.distributed.barrier()
    out["crashed"] = _listing(path)
    out["loaded_meanwhile"] = checkpoint.load(path, model)["extra"]
    checkpoint.save(path, model, extra={"which": "after"})
    out["recovered"] = _listing(path) | {"extra": checkpoint.load(path, model)["extra"]}
    return out


def rank_train_and_save(path: str, steps: int, extra_steps: int, dist_opt: bool) -> dict:
    from mnb.megatron import checkpoint

    model = build(tp=2, pp=1)
    train(model, steps, use_distributed_optimizer=dist_opt)
    checkpoint.save(path, model)
    return {"next_losses": train(model, extra_steps, use_distributed_optimizer=dist_opt)}


def rank_load_and_continue(path: str, tp: int, pp: int, extra_steps: int, dist_opt: bool) -> dict:
    from mnb.megatron import checkpoint

    model = build(tp=tp, pp=pp, seed=999)  # other weights: everything must come from the file
    info = checkpoint.load(path, model)    # never trained: gets its optimizer from the file
    return {"next_losses": train(model, extra_steps, use_distributed_optimizer=dist_opt),
            "optimizer_loaded": info["optimizer_loaded"], "rng_loaded": info["rng_loaded"],
            "step": info["step"]}


SCHEDULE = dict(lr=3e-3, min_lr=3e-4, warmup_steps=3, lr_decay_style="cosine", micro_batch_size=2,
                global_batch_size=4, data="mock")


def rank_schedule_continues(path: str) -> dict:
    """10 steps of warm-up + cosine: in one call, as 5 + 5, and 5, save, load (same layout; pp2), 5."""
    from mnb.megatron import checkpoint
    from mnb.megatron.train import train as mnb_train

    def run(model, **kwargs):
        record = mnb_train(model, **kwargs)
        rows = record["steps"]
        return {"loss": [r["loss"] for r in rows], "lr": [r["lr"] for r in rows], "step": [r["step"] for r in rows],
                "schedule_steps": record["train"]["schedule_steps"]}

    once = run(build(tp=2, pp=1), steps=10, **SCHEDULE)
    model = build(tp=2, pp=1)
    first = run(model, steps=5, schedule_steps=10, **SCHEDULE)
    checkpoint.save(path, model)
    second = run(model, steps=5)  # names nothing: the same schedule, batch and data continue
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        past = run(model, steps=1)  # past the schedule's end: min_lr, and rank 0 says so
    past["warned"] = [str(w.message) for w in caught if "mnb.train" in str(w.message)]
    past["warned_at"] = [Path(w.filename).name for w in caught if "mnb.train" in str(w.message)]
    resumed = {}
    for name, (tp, pp) in (("same-layout", (2, 1)), ("pp2", (1, 2))):
        fresh = build(tp=tp, pp=pp, seed=999)  # other weights: everything comes from the checkpoint
        info = checkpoint.load(path, fresh)
        resumed[name] = {**run(fresh, steps=5), "schedule_loaded": info["schedule_loaded"], "info": repr(info)}
    return {"once": once, "first": first, "second": second, "past": past, "resumed": resumed}


def rank_save_then_fail(path: str, mode: str) -> dict:
    import torch
    from megatron.core import dist_checkpointing

    from mnb.megatron import checkpoint

    model = build(tp=2, pp=1)
    train(model, 1)
    checkpoint.save(path, model)
    good = snapshot(model)
    torch.save(good, Path(path).parent / f"good-rank{torch.distributed.get_rank()}.pt")
    train(model, 1)
    real_save = dist_checkpointing.save

    def partial_save(state, directory, *args, **kwargs):
        real_save(state, directory, *args, **kwargs)  # tensors written; no mnb.json, no rename
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


def rank_mismatch(path: str) -> dict:
    from mnb.megatron import checkpoint

    model = build(tp=2, pp=1)
    checkpoint.save(path, model)
    other = build(tp=2, pp=1, num_layers=2)
    try:
        checkpoint.load(path, other)
    except ValueError as err:
        return {"refused": str(err)}
    return {"refused": None}


def rank_without_cpu_mode(path: str) -> dict:
    """No mnb.megatron.cpu.install(): checkpoint.py's own CUDA fallback must carry the save."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from mnb.megatron import checkpoint, cpu

    assert not cpu.installed()
    ps.initialize_model_parallel(1, 1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    class Sharded(torch.nn.Module):  # one weight, split over the ranks along dim 0
        def __init__(self, value):
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((2, 3), float(value)))

        def sharded_state_dict(self, prefix=""):
            return {"w": ShardedTensor.from_rank_offsets(prefix + "w", self.w.detach(),
                                                         (0, rank, world), replica_id=0)}

    checkpoint.save(path, Sharded(rank + 1))
    fresh = Sharded(-1)
    checkpoint.load(path, fresh)
    return {"ok": bool(torch.equal(fresh.w, torch.full((2, 3), float(rank + 1))))}


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: len(file.read_bytes()) // 2])


# One copy of a good checkpoint per case: (file damaged, how) -> what the error must say.
DAMAGES = {
    "mnb-truncated": ("mnb.json", _truncate, "mnb.json is not valid JSON (line "),
    "mnb-not-json": ("mnb.json", lambda f: f.write_text("step=2"),
                     "mnb.json is not valid JSON (line 1 column 1: Expecting value)"),
    "mnb-empty": ("mnb.json", lambda f: f.write_text(""), "mnb.json is empty (0 bytes)"),
    "mnb-missing-fields": ("mnb.json", lambda f: f.write_text('{"step": 2}'),
                           "mnb.json lacks field(s) format, layout, optimizer"),
    "metadata-truncated": ("metadata.json", _truncate, "metadata.json is not valid JSON (line 1 column "),
    "metadata-missing-fields": ("metadata.json", lambda f: f.write_text("{}"),
                                "metadata.json lacks field(s) sharded_backend"),
    "metadata-missing": ("metadata.json", Path.unlink, "metadata.json is missing"),
    "plain-megatron-metadata-truncated": ("metadata.json", lambda f: (_truncate(f), (f.parent / "mnb.json").unlink()),
                                          "metadata.json is not valid JSON (line 1 column "),
}


def _sharded(value: float):
    """A module with one (2, 3) weight: this rank's rows of one (2 * world, 3) tensor."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    class Sharded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((2, 3), value))

        def sharded_state_dict(self, prefix=""):
            return {"w": ShardedTensor.from_rank_offsets(prefix + "w", self.w.detach(), (0, rank, world),
                                                         replica_id=0)}

    return Sharded()


def rank_load_damaged(path: str) -> dict:
    """Save once; load a copy damaged in each way of DAMAGES; then load the intact one."""
    import torch

    from mnb.config import ParallelConfig
    from mnb.megatron import checkpoint
    from mnb.megatron.layout import apply_layout

    apply_layout(ParallelConfig())
    rank = torch.distributed.get_rank()
    checkpoint.save(path, _sharded(rank + 1.0))
    errors = {}
    for case, (name, damage, _) in DAMAGES.items():
        copy = Path(path).with_name(f"{Path(path).name}-{case}")
        if rank == 0:
            shutil.copytree(path, copy)
            damage(copy / name)
        torch.distributed.barrier()
        try:
            checkpoint.load(str(copy), _sharded(-1.0))
        except Exception as exc:  # the test reads the type and the message
            errors[case] = f"{type(exc).__name__}: {exc}"
        else:
            errors[case] = None
    fresh = _sharded(-1.0)
    checkpoint.load(path, fresh)
    return {"path": path, "errors": errors, "intact": bool(torch.equal(fresh.w, torch.full((2, 3), rank + 1.0)))}


def _saved(path: Path) -> dict:
    """What a save left: the entries of ``path`` (through a link) and of its parent, and the loaded value."""
    import torch

    from mnb.megatron import checkpoint

    fresh = _sharded(-1.0)
    info = checkpoint.load(path, fresh)
    seen = {"entries": sorted(os.listdir(path)), "beside": sorted(os.listdir(path.parent)),
            "value": fresh.w[0, 0].item(), "extra": info["extra"], "same": bool(torch.equal(fresh.w, fresh.w[0, 0]
                                                                                        .expand_as(fresh.w)))}
    # every rank has looked before any goes on: rank 0's next save creates its temporary folder before its first
    # collective (CI leg 1 on aeccd54: rank 1, loaded, listed the next save's .mnb-tmp- folder)
    torch.distributed.barrier()
    return seen


def _failure(run) -> str | None:
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - the test compares type and message across ranks
        return f"{type(exc).__name__}: {exc}"
    return None


def rank_links_and_mount_points(root: str) -> dict:
    """A link to a folder is followed (the link stays); a folder that cannot be renamed (a mount point:
    ``writes.is_mount_point`` says so and renaming it fails with EBUSY, as the kernel's does) is written
    inside; a failed write, a failed rename and an unwritable target raise the same error on every rank."""
    import errno

    import torch

    from mnb import writes
    from mnb.config import ParallelConfig
    from mnb.megatron import checkpoint
    from mnb.megatron.layout import apply_layout
    from megatron.core import dist_checkpointing

    apply_layout(ParallelConfig())
    rank, base = torch.distributed.get_rank(), Path(root)
    out: dict = {}
    real, link, vol, plain = base / "disk" / "target", base / "link", base / "mnt" / "vol", base / "plain" / "ck"
    if rank == 0:
        for folder in (real, vol, plain.parent):
            folder.mkdir(parents=True)
        link.symlink_to(real)
    torch.distributed.barrier()

    for value in (1.0, 2.0):  # the second save replaces the first, through the link
        checkpoint.save(link, _sharded(rank + value), extra={"v": value})
    out["link"] = {**_saved(link), "is_link": link.is_symlink(), "points_to": os.readlink(link),
                   "disk": sorted(os.listdir(real.parent))}

    real_replace, real_rename, real_ismount = os.replace, os.rename, writes.is_mount_point
    busy = {str(vol)}  # renaming these fails as renaming a mount point does

    def no_rename(real_call):
        def call(src, dst, *args, **kwargs):
            if str(src) in busy or str(dst) in busy:
                raise OSError(errno.EBUSY, "Device or resource busy", str(src))
            return real_call(src, dst, *args, **kwargs)
        return call

    os.replace, os.rename = no_rename(real_replace), no_rename(real_rename)
    writes.is_mount_point = lambda path: str(path) == str(vol) or real_ismount(path)
    try:
        checkpoint.save(vol, _sharded(rank + 1.0), extra={"v": 1})  # an empty mount point
        if rank == 0:
            (vol / "notes.txt").write_text("mine")
        torch.distributed.barrier()
        checkpoint.save(vol, _sharded(rank + 2.0), extra={"v": 2})  # replaces the first inside the folder
        out["mount"] = {**_saved(vol), "notes": (vol / "notes.txt").read_text()}

        real_save = dist_checkpointing.save

        def fails_on_rank_1(state, directory, *args, **kwargs):
            real_save(state, directory, *args, **kwargs)
            if rank == 1:
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")

        dist_checkpointing.save = fails_on_rank_1
        try:
            out["write_failed"] = _failure(lambda: checkpoint.save(vol, _sharded(rank + 3.0), extra={"v": 3}))
        finally:
            dist_checkpointing.save = real_save
        out["after_write_failed"] = _saved(vol)

        real_mkdir = Path.mkdir

        def read_only(self, *args, **kwargs):
            if self.parent == vol:
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            return real_mkdir(self, *args, **kwargs)

        Path.mkdir = read_only
        try:
            out["unwritable"] = _failure(lambda: checkpoint.save(vol, _sharded(rank + 4.0)))
        finally:
            Path.mkdir = real_mkdir
        out["after_unwritable"] = _saved(vol)

        # a folder nothing says is fixed, whose rename fails anyway (a bind mount ismount misses): rank 0
        # fails at the swap; every rank must hear of it (before: rank 1 waited in a barrier)
        checkpoint.save(plain, _sharded(rank + 1.0), extra={"v": 1})
        busy.add(str(plain))
        out["rename_failed"] = _failure(lambda: checkpoint.save(plain, _sharded(rank + 5.0), extra={"v": 5}))
    finally:
        os.replace, os.rename, writes.is_mount_point = real_replace, real_rename, real_ismount
    out["after_rename_failed"] = _saved(plain)
    return out


def rank_scenarios(root: str, killed: str) -> dict:
    """Every scenario that needs no process of its own, in turn, each on its own folder under ``root``;
    a scenario that raises leaves its traceback (``{"error": ...}``) and the next one still runs.
    ``killed``: the checkpoint whose next save was killed midway (``killed_save``)."""
    import torch

    def guarded(run, *args, **kwargs):
        try:
            return run(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the test shows the rank's traceback
            return {"error": traceback.format_exc()}
        finally:
            torch.distributed.barrier()

    base = Path(root)

    def resume() -> dict:  # save at tp2 after 2 steps; a fresh model at pp2 loads it
        path = str(base / "resume" / "run")
        straight = rank_train_and_save(path, steps=2, extra_steps=2, dist_opt=True)
        return {"straight": straight,
                "resumed": rank_load_and_continue(path, tp=1, pp=2, extra_steps=2, dist_opt=True)}

    return {
        "round_trip": guarded(rank_round_trip, str(base / "round-trip" / "a")),
        "resume": guarded(resume),
        "schedule": guarded(rank_schedule_continues, str(base / "schedule" / "sched")),
        "failed_save": guarded(rank_save_then_fail, str(base / "failed" / "run"), mode="raise"),
        "after_killed_save": guarded(rank_load_good, killed),
        "mismatch": guarded(rank_mismatch, str(base / "mismatch" / "m")),
        "damaged": guarded(rank_load_damaged, str(base / "damaged" / "ckpt" / "good")),
        "links_and_mounts": guarded(rank_links_and_mount_points, str(base / "links")),
    }


# -- tests (parent side) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def killed_save(tmp_path_factory) -> dict:
    """Save after a step, then kill both ranks in the middle of the next save."""
    tmp = tmp_path_factory.mktemp("killed")
    path = tmp / "ckpt" / "run"
    ranks = start_ranks(rank_save_then_fail, 2, tmp, path=str(path), mode="hang")
    try:
        deadline = time.monotonic() + 240
        while not (path.parent / "save-started").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks.procs), ranks.log(0)[-3000:]
            time.sleep(0.1)
    finally:
        ranks.kill()  # mid-save: new tensors written into run.tmp-*, nothing renamed
    return {"path": path, "partial": list(path.parent.glob("run.tmp-*")),
            "outlived": [p.pid for p in ranks.procs if _group_alive(p.pid)]}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory, killed_save) -> list[dict]:
    """``rank_scenarios``' results, rank by rank (one launch)."""
    tmp = tmp_path_factory.mktemp("scenarios")
    return run_ranks(rank_scenarios, 2, tmp, timeout_s=900, root=str(tmp / "ckpt"), killed=str(killed_save["path"]))


def test_round_trip_is_bitwise(scenarios):
    for r in scenarios:
        r = ok(r["round_trip"])
        assert r["diff"] == []
        assert r["progress"] == [2, 8]  # steps_done, consumed_samples restored
        assert r["info"] == {"step": 2, "optimizer_loaded": True, "rng_loaded": True,
                             "extra": {"note": "after 2 steps"}}
        assert r["files"] == ["a"]  # no .tmp-/.old- leftovers


def test_a_save_keeps_the_users_files_and_finishes_a_crashed_swap(scenarios):
    kept = {"notes": "mine", "data": "1,2"}
    for r in (ok(u["round_trip"])["users"] for u in scenarios):
        assert r["resaved"] == {"siblings": ["a"], **kept}, r["resaved"]
        refused = r["refused"]
        assert refused is not None and refused == ok(scenarios[0]["round_trip"])["users"]["refused"]  # the same on every rank
        assert refused.startswith("mnb.save: ") and "theirs is not empty and holds no mnb checkpoint: " \
            "notes.txt, sub/ (2 entries)" in refused and "overwrite=True" in refused, refused
        assert r["after_refusal"] == {"siblings": ["theirs"], **kept, "entries": ["notes.txt", "sub"]}
        assert r["overwritten"] == {"siblings": ["theirs"], **kept, "extra": {"which": "theirs"}}
        assert r["crashed"] == {"siblings": ["a.old-crashed", "a.tmp-crashed"], "notes": None, "data": None}
        assert r["loaded_meanwhile"] == {"which": "newer"}  # the complete new one, before any rename
        assert r["recovered"] == {"siblings": ["a"], **kept, "extra": {"which": "after"}}


def test_resume_in_another_layout_continues_the_loss(scenarios):
    """Save at tp=2 after 2 steps (distributed optimizer), load at pp=2 into a model with other
    weights: the next 2 losses equal the uninterrupted run's.

    Plain Adam's case is test_schedule_and_data_continue_across_calls_saves_and_layouts."""
    expected = ok(scenarios[0]["resume"])["straight"]["next_losses"]
    for r in scenarios:
        r = ok(r["resume"])["resumed"]
        assert r["step"] == 2 and r["optimizer_loaded"] and not r["rng_loaded"]
        assert r["next_losses"] == pytest.approx(expected, abs=1e-5), (r["next_losses"], expected)


def test_schedule_and_data_continue_across_calls_saves_and_layouts(scenarios):
    """Warm-up + cosine over 10 steps: a restarted schedule would warm up again from lr 0."""
    for r in (ok(r["schedule"]) for r in scenarios):
        once, first, second = r["once"], r["first"], r["second"]
        assert once["lr"][0] == 0.0 and once["lr"][3] == pytest.approx(3e-3) and once["lr"][-1] > 3e-4
        assert first["lr"] + second["lr"] == once["lr"]  # the same schedule, step by step
        assert first["loss"] + second["loss"] == once["loss"]
        assert second["step"] == [6, 7, 8, 9, 10] and second["schedule_steps"] == 10
        assert r["past"]["lr"] == [pytest.approx(3e-4)] and r["past"]["step"] == [11]
        assert len(r["past"]["warned"]) == (1 if r is ok(scenarios[0]["schedule"]) else 0)
        assert all("schedule of 10 steps is at step 10" in w and "schedule_steps" in w for w in r["past"]["warned"])
        assert all(name == "test_checkpoint.py" for name in r["past"]["warned_at"])  # the caller's line, not mnb's
        for name, resumed in r["resumed"].items():
            assert resumed["schedule_loaded"] and resumed["step"] == [6, 7, 8, 9, 10], name
            assert resumed["info"].endswith(": step 5, saved under tp2 pp1 dp1; weights, optimizer, schedule"
                                            + (", rng loaded>" if name == "same-layout" else " loaded>"))
            assert resumed["lr"] == pytest.approx(once["lr"][5:], rel=1e-12), name
            assert resumed["loss"] == pytest.approx(once["loss"][5:], abs=1e-5), (name, resumed["loss"], once["loss"])


def test_failed_save_keeps_the_last_checkpoint(scenarios):
    for r in scenarios:
        r = ok(r["failed_save"])
        assert r["diff"] == [] and r["step"] == 1


def test_killed_save_keeps_the_last_checkpoint(killed_save, scenarios):
    assert killed_save["partial"]  # killed after writing into run.tmp-*
    assert not killed_save["outlived"], "a rank's checkpoint writers outlived it"
    for r in scenarios:
        r = ok(r["after_killed_save"])
        assert r["diff"] == [] and r["step"] == 1


def test_load_into_a_different_model_says_what_differs(scenarios):
    for r in scenarios:
        assert "num_layers: checkpoint 4, model 2" in ok(r["mismatch"])["refused"]


def test_save_without_cpu_mode_uses_the_local_fallback(tmp_path):
    results = run_ranks(rank_without_cpu_mode, 2, tmp_path, cpu_mode=False, path=str(tmp_path / "ckpt" / "w"))
    assert [r["ok"] for r in results] == [True, True]


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


def test_next_save_finishes_an_interrupted_swap(tmp_path):
    from mnb import writes
    from mnb.megatron.checkpoint import read_meta

    for name, step in (("run.old-aaa", 1), ("run.tmp-bbb", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metadata.json").write_text("{}")
        (tmp_path / name / "mnb.json").write_text(json.dumps({"step": step, "time": step}))
    (tmp_path / "run.tmp-ccc").mkdir()
    writes.recover(tmp_path / "run", writes.MNB_CHECKPOINT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert read_meta(tmp_path / "run")["step"] == 2


@pytest.fixture(scope="module")
def damaged_loads(scenarios):
    return [ok(r["damaged"]) for r in scenarios]


@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_damaged_checkpoint_names_folder_file_and_fault(damaged_loads, case):
    folder = Path(damaged_loads[0]["path"]).parent
    expected = f"DamagedCheckpointError: checkpoint {folder / ('good-' + case)} is damaged: {DAMAGES[case][2]}"
    assert damaged_loads[0]["errors"][case].startswith(expected), damaged_loads[0]["errors"][case]


def test_damaged_checkpoint_error_says_what_to_do(damaged_loads):
    assert all(e.endswith("; re-save it or load another") for e in damaged_loads[0]["errors"].values())


def test_every_rank_reports_the_same_damage(damaged_loads):
    assert damaged_loads[0]["errors"] == damaged_loads[1]["errors"]


def test_intact_checkpoint_loads_after_the_damaged_ones(damaged_loads):
    assert [r["intact"] for r in damaged_loads] == [True, True]


def test_save_refuses_a_model_of_nothing_and_paths_follow_the_home_folder(tmp_path, monkeypatch):
    """mnb.save(path, []) wrote a checkpoint of no chunks over a real one (and load then failed on it); '~/ckpt'
    made a folder named '~' in the current directory."""
    from mnb.megatron import checkpoint

    for nothing in ([], (), ["not a module"]):
        with pytest.raises(TypeError, match="non-empty list of modules"):
            checkpoint._chunks(nothing)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / checkpoint.META_FILE).write_text(json.dumps({"format": 1}))
    (tmp_path / "ckpt" / "metadata.json").write_text("{}")  # Megatron's: with mnb.json, a complete checkpoint
    assert checkpoint.find_checkpoint("~/ckpt") == tmp_path / "ckpt"
    assert checkpoint.read_meta("~/ckpt") == {"format": 1}


# -- links, mount points, unwritable targets ------------------------------------------------

_OWN = [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json", "mnb.json"]
"""What a save of the small sharded module leaves, but ``common.pt`` (megatron-core 0.16 writes it, 0.19 not)."""


def _own(entries: list[str]) -> list[str]:
    return [e for e in entries if e != "common.pt"]


@pytest.fixture(scope="module")
def links_and_mounts(scenarios) -> list[dict]:
    return [ok(r["links_and_mounts"]) for r in scenarios]


def test_a_save_through_a_link_writes_into_its_folder_and_keeps_the_link(links_and_mounts):
    """ck_link -> /data/target: the link was renamed to ck_link.old-ID and a real folder written in its place."""
    for rank, r in enumerate(links_and_mounts):
        link = r["link"]
        assert link["is_link"] and link["points_to"].endswith("disk/target"), link
        assert link["beside"] == ["disk", "link", "mnt", "plain"], link  # no link.old-/link.tmp- leftovers
        assert link["disk"] == ["target"], link  # nor beside the folder it points to
        assert _own(link["entries"]) == _OWN and link["value"] == rank + 2.0 and link["extra"] == {"v": 2.0}, link


def test_a_folder_that_cannot_be_renamed_is_written_inside(links_and_mounts):
    """A mount point (renaming it fails with EBUSY): the save, then a second one replacing it, inside it;
    nothing beside it, nothing left inside but the checkpoint and the user's notes."""
    for rank, r in enumerate(links_and_mounts):
        mount = r["mount"]
        assert mount["beside"] == ["vol"], mount
        assert _own(mount["entries"]) == sorted(_OWN + ["notes.txt"]) and mount["notes"] == "mine", mount
        assert mount["value"] == rank + 2.0 and mount["extra"] == {"v": 2}, mount


def test_a_failed_write_inside_raises_the_same_on_every_rank_and_keeps_the_last_checkpoint(links_and_mounts):
    failed = [r["write_failed"] for r in links_and_mounts]
    assert failed[0] is not None and failed == [failed[0]] * len(failed), failed
    assert failed[0].startswith("OSError: mnb.save(") and "failed on rank 1, the last checkpoint is unchanged" \
        in failed[0] and "No space left on device (simulated)" in failed[0], failed[0]
    for rank, r in enumerate(links_and_mounts):  # the temporary folder is gone; the save before it loads
        assert r["after_write_failed"] == {k: v for k, v in r["mount"].items() if k != "notes"}, r["after_write_failed"]


def test_an_unwritable_target_is_refused_on_every_rank_saying_what_to_change(links_and_mounts):
    refused = [r["unwritable"] for r in links_and_mounts]
    assert refused[0] is not None and refused == [refused[0]] * len(refused), refused
    assert refused[0].startswith("OSError: mnb.save: cannot write into ") and "(it is a mount point, so mnb " \
        "writes inside it): Read-only file system; nothing was written. Remount it read-write, or choose a folder " \
        in refused[0], refused[0]
    for r in links_and_mounts:
        assert r["after_unwritable"] == {k: v for k, v in r["mount"].items() if k != "notes"}, r["after_unwritable"]


def test_a_rename_that_fails_at_the_swap_fails_on_every_rank_and_cleans_up(links_and_mounts):
    """Rank 0 alone failed at the rename (EBUSY) while rank 1 waited in a barrier: the pool restarted."""
    failed = [r["rename_failed"] for r in links_and_mounts]
    assert failed[0] is not None and failed == [failed[0]] * len(failed), failed
    assert "failed on rank 0, the last checkpoint is unchanged: OSError: [Errno 16] Device or resource busy" \
        in failed[0], failed[0]
    for rank, r in enumerate(links_and_mounts):
        after = r["after_rename_failed"]
        assert after["beside"] == ["ck"] and after["value"] == rank + 1.0 and after["extra"] == {"v": 1}, after


def _fake_checkpoint(folder: Path, step: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metadata.json").write_text("{}")
    (folder / f"__{step}_0.distcp").write_text(str(step))  # each save has its own shard file
    (folder / "mnb.json").write_text(json.dumps({"step": step, "time": step}))
    return folder


def _state(folder: Path) -> tuple:
    from mnb import writes

    found = writes.find(folder, writes.MNB_CHECKPOINT)
    meta = json.loads((found / "mnb.json").read_text()) if found else None
    shards = sorted(n for n in os.listdir(found) if n.endswith(".distcp")) if found else None
    return (meta or {}).get("step"), shards


def test_filling_a_folder_in_place_keeps_one_complete_checkpoint_at_every_rename(tmp_path, monkeypatch):
    """writes.fill, stopped after each of its renames in turn (a crash): a load reads the old or the new
    checkpoint, whole (its own shard only), never a mix; the next save's recover finishes it; notes stay."""
    from mnb import writes

    calls = {"n": 0, "stop": None}
    real_replace = os.replace

    def counted(src, dst):
        if calls["stop"] is not None and calls["n"] == calls["stop"]:
            raise KeyboardInterrupt("killed")
        calls["n"] += 1
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", counted)
    for stop in range(20):
        vol = tmp_path / str(stop) / "vol"
        _fake_checkpoint(vol, 1)
        (vol / "notes.txt").write_text("mine")
        _fake_checkpoint(vol / ".mnb-tmp-new", 2)
        calls.update(n=0, stop=stop)
        try:
            writes.fill(vol / ".mnb-tmp-new", vol, writes.MNB_CHECKPOINT)
        except KeyboardInterrupt:
            pass
        else:
            break
        calls["stop"] = None
        assert _state(vol) in ((1, ["__1_0.distcp"]), (2, ["__2_0.distcp"])), (stop, sorted(os.listdir(vol)))
        writes.recover(vol, writes.MNB_CHECKPOINT)
        after = _state(vol)
        assert after in ((1, ["__1_0.distcp"]), (2, ["__2_0.distcp"])), stop
        assert writes.find(vol, writes.MNB_CHECKPOINT) == vol and (vol / "notes.txt").read_text() == "mine"
        assert not [n for n in os.listdir(vol) if n.startswith(".mnb-") or n.endswith(".part")], os.listdir(vol)
    assert stop > 5, "fill finished without being stopped: nothing was tested"
    assert _state(vol) == (2, ["__2_0.distcp"]) and sorted(os.listdir(vol)) == [
        "__2_0.distcp", "metadata.json", "mnb.json", "notes.txt"]


def test_a_fill_that_fails_at_any_rename_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    """writes.finish inside a folder whose n-th rename fails (EBUSY, once): the save's error, the old
    checkpoint in place as it was, the user's notes kept, nothing of the new one left."""
    import errno

    from mnb import writes

    calls = {"n": 0, "stop": None}
    real_replace = os.replace

    def failing(src, dst):
        if calls["n"] == calls["stop"]:
            calls["stop"] = None
            raise OSError(errno.EBUSY, "Device or resource busy")
        calls["n"] += 1
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    for stop in range(20):
        vol = tmp_path / str(stop) / "vol"
        _fake_checkpoint(vol, 1)
        (vol / "notes.txt").write_text("mine")
        plan = writes.Plan(vol, _fake_checkpoint(vol / ".mnb-tmp-new", 2), inside="it is a mount point")
        calls.update(n=0, stop=stop)
        try:
            writes.finish(plan, writes.MNB_CHECKPOINT)
        except OSError:
            pass
        else:
            break
        assert _state(vol) == (1, ["__1_0.distcp"]) and writes.find(vol, writes.MNB_CHECKPOINT) == vol, stop
        assert sorted(os.listdir(vol)) == ["__1_0.distcp", "metadata.json", "mnb.json", "notes.txt"], stop
    assert stop > 5 and _state(vol) == (2, ["__2_0.distcp"])


def test_prepare_decides_where_to_write(tmp_path, monkeypatch):
    """A link is followed; a mount point, or a folder whose parent is read-only, is written inside."""
    from mnb import writes

    kind = writes.MNB_CHECKPOINT
    real = tmp_path / "disk" / "target"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    plan = writes.agree(writes.prepare(tmp_path / "link", kind, overwrite=False, writer="mnb.save"))
    assert plan.path == real and plan.tmp.parent == real.parent and plan.tmp.name.startswith("target.tmp-")
    assert not plan.inside and (tmp_path / "link").is_symlink()

    monkeypatch.setattr(writes, "is_mount_point", lambda path: path == real)
    plan = writes.agree(writes.prepare(tmp_path / "link", kind, overwrite=False, writer="mnb.save"))
    assert plan.inside == "it is a mount point" and plan.tmp.parent == real and plan.tmp.name.startswith(".mnb-tmp-")
    writes.discard(plan)
    (real / "lost+found").mkdir()  # an ext4 volume's own: the mount point still counts as empty
    writes.check_folder(real, kind, overwrite=False, writer="mnb.save")


def test_a_folder_whose_parent_is_read_only_is_written_inside_and_an_unwritable_one_refused(tmp_path):
    from mnb import writes

    kind = writes.MNB_CHECKPOINT
    pinned = tmp_path / "ro" / "ck"
    pinned.mkdir(parents=True)
    pinned.parent.chmod(0o555)
    try:
        if os.access(pinned.parent, os.W_OK):  # root (CAP_DAC_OVERRIDE): no permission stops a rename
            pytest.skip("permissions do not apply to this user (root): the mount-point case is tested with ranks")
        assert writes.unrenamable(pinned) == f"its parent {pinned.parent} is not writable"
        plan = writes.agree(writes.prepare(pinned, kind, overwrite=False, writer="mnb.save"))
        assert plan.tmp.parent == pinned
        with pytest.raises(OSError) as rename:  # what the swap would have met
            os.rename(pinned, pinned.with_name("ck.old-x"))
        assert rename.value.errno == 13
        pinned.chmod(0o555)  # not writable at all: refused, saying what to change
        with pytest.raises(OSError, match=r"cannot write into .*ck \(its parent .* is not writable, so mnb writes "
                           r"inside it\): Permission denied; nothing was written. Choose a folder"):
            writes.agree(writes.prepare(pinned, kind, overwrite=False, writer="mnb.save"))
    finally:
        pinned.chmod(0o755)
        pinned.parent.chmod(0o755)
