"""mnb.writes: the refusal of targets that are not a writer's own, and the atomic folder swap with
crash recovery that mnb.save and mnb.save_hf share (their rank-side tests: tests/megatron/test_checkpoint.py,
tests/megatron/test_hf.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mnb import writes
from mnb.errors import OverwriteRefusedError

HF = writes.HF_CHECKPOINT


def _hf(folder: Path, weights: str = "w1") -> Path:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_text(weights)
    (folder / "config.json").write_text("{}")
    return folder


def _users(folder: Path) -> None:
    (folder / "notes.txt").write_text("mine")
    (folder / "sub").mkdir()
    (folder / "sub" / "data.csv").write_text("1,2")


def _kept(folder: Path) -> None:
    assert (folder / "notes.txt").read_text() == "mine"
    assert (folder / "sub" / "data.csv").read_text() == "1,2"


def test_a_folder_of_user_files_is_refused_listing_it_and_the_flag(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    _users(target)
    with pytest.raises(OverwriteRefusedError) as info:
        writes.check_folder(target, HF, overwrite=False, writer="mnb.save_hf")
    text = str(info.value)
    assert f"mnb.save_hf: {target} is not empty and holds no Hugging Face checkpoint: notes.txt, sub/ (2 entries)" \
        in text, text
    assert "overwrite=True" in text and "notes.txt, sub/ (2 entries) stay" in text, text
    writes.check_folder(target, HF, overwrite=True, writer="mnb.save_hf")  # allowed with the flag
    for allowed in (tmp_path / "new", _hf(tmp_path / "ckpt")):
        writes.check_folder(allowed, HF, overwrite=False, writer="mnb.save_hf")
    (tmp_path / "empty").mkdir()
    writes.check_folder(tmp_path / "empty", HF, overwrite=False, writer="mnb.save_hf")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OverwriteRefusedError, match="is a file, not a folder"):
        writes.check_folder(tmp_path / "file", HF, overwrite=True, writer="mnb.save_hf")


def test_a_long_listing_is_cut(tmp_path):
    for i in range(12):
        (tmp_path / f"f{i:02d}").write_text("")
    assert writes.listing(tmp_path).endswith("f07 and 4 more (12 entries)")


def test_swap_replaces_only_its_own_files(tmp_path):
    path = _hf(tmp_path / "out")
    (path / "model-00001-of-00002.safetensors").write_text("stale shard")
    _users(path)
    tmp = _hf(writes.tmp_path(path, "abc"), "w2")
    writes.swap(tmp, path, HF)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .tmp-/.old- left
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "notes.txt", "sub"]
    assert (path / "model.safetensors").read_text() == "w2"
    _kept(path)


def _crashed_between_renames(tmp_path: Path) -> Path:
    """What a swap leaves when it stops after moving the old folder aside: only .old- and .tmp-."""
    path = _hf(tmp_path / "out")
    _users(path)
    tmp = _hf(writes.tmp_path(path, "abc"), "w2")
    path.rename(path.with_name("out.old-abc"))  # the first rename; the second never happens
    (tmp_path / "out.tmp-dead").mkdir()  # a save that died while writing: incomplete
    assert writes.find(path, HF) == tmp
    return path


def test_the_next_save_finishes_a_swap_stopped_between_its_renames(tmp_path):
    path = _crashed_between_renames(tmp_path)
    writes.recover(path, HF)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (path / "model.safetensors").read_text() == "w2"
    _kept(path)


def test_recovery_after_the_second_rename_moves_the_users_files_over(tmp_path):
    path = _crashed_between_renames(tmp_path)
    writes.tmp_path(path, "abc").rename(path)  # the second rename, then a stop before the clean-up
    writes.recover(path, HF)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    _kept(path)


def test_an_overwritten_user_folder_comes_back_when_nothing_complete_was_left(tmp_path):
    path = tmp_path / "out"
    path.mkdir()
    _users(path)
    path.rename(path.with_name("out.old-abc"))
    writes.recover(path, HF)
    assert sorted(p.name for p in path.iterdir()) == ["notes.txt", "sub"]
    _kept(path)


def test_find_prefers_the_new_copy_then_the_newest(tmp_path):
    def fake(name, t):
        d = tmp_path / name
        d.mkdir()
        (d / "metadata.json").write_text("{}")
        (d / "mnb.json").write_text(json.dumps({"time": t}))
        return d

    fake("run.old-aaa", 2)
    older = fake("run.old-bbb", 1)
    os.utime(older, (0, 2e9))  # the newest folder on disk, but mnb.json's "time" decides
    assert writes.find(tmp_path / "run", writes.MNB_CHECKPOINT) == tmp_path / "run.old-aaa"
    new = fake("run.tmp-ccc", 0)
    assert writes.find(tmp_path / "run", writes.MNB_CHECKPOINT) == new  # the new copy wins
    (tmp_path / "run.tmp-ddd").mkdir()
    (tmp_path / "run.tmp-ddd" / "metadata.json").write_text("{}")
    (tmp_path / "run.tmp-ddd" / "mnb.json").write_text('{"time": 3')  # truncated: not complete
    assert writes.find(tmp_path / "run", writes.MNB_CHECKPOINT) == new


def test_check_file_refuses_a_foreign_file(tmp_path):
    target = tmp_path / "train.sbatch"
    target.write_text("#!/bin/bash\nmy own job\n")
    own = lambda p: p.read_text().startswith("# mnb")  # noqa: E731
    with pytest.raises(OverwriteRefusedError) as info:
        writes.check_file(target, own, overwrite=False, writer="mnb.export", what="an mnb export",
                          flag="--overwrite")
    assert f"mnb.export: {target} exists (23 bytes) and is not an mnb export" in str(info.value)
    assert "--overwrite" in str(info.value)
    writes.check_file(target, own, overwrite=True, writer="mnb.export", what="an mnb export")
    target.write_text("# mnb export\n")
    writes.check_file(target, own, overwrite=False, writer="mnb.export", what="an mnb export")
    with pytest.raises(OverwriteRefusedError, match="is a folder"):
        writes.check_file(tmp_path, own, overwrite=True, writer="mnb.export", what="an mnb export")
