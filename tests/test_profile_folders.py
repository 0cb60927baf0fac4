"""``%mnb profile delete``: mnb removes what it wrote in a profile folder and keeps a user's files there
(the profiles themselves: tests/megatron/test_profile.py)."""

from __future__ import annotations

import argparse

import pytest
from IPython.core.error import UsageError

from mnb.notebook.profile_commands import profile_request, run_profile_command


def _profile(folder):
    for sub in ("trace", "meta", "memory"):
        (folder / sub).mkdir(parents=True)
        (folder / sub / "rank-0.json").write_text("{}")
    (folder / "merged.trace.json").write_text("{}")


def test_delete_keeps_what_mnb_did_not_write(tmp_path, capsys):
    folder = tmp_path / "profile-20261203-120000"
    _profile(folder)
    (folder / "notes.txt").write_text("slow step 3")
    (folder / "sub").mkdir()
    (folder / "sub" / "plot.png").write_bytes(b"png")
    run_profile_command(argparse.Namespace(action="delete", target=str(folder)), None)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "sub"]
    assert (folder / "notes.txt").read_text() == "slow step 3" and (folder / "sub" / "plot.png").exists()
    assert "kept what mnb did not write there: notes.txt, sub" in capsys.readouterr().out
    plain = tmp_path / "profile-2"
    _profile(plain)
    run_profile_command(argparse.Namespace(action="delete", target=str(plain)), None)
    assert not plain.exists() and f"deleted {plain}" in capsys.readouterr().out
    with pytest.raises(UsageError, match="is not a profile folder"):
        run_profile_command(argparse.Namespace(action="delete", target=str(folder)), None)


def test_an_output_that_is_a_file_is_refused_before_the_cell(tmp_path):
    target = tmp_path / "results"
    target.write_text("mine")
    args = argparse.Namespace(profile="", profile_ranks=None, output=str(target), memory=False)
    with pytest.raises(UsageError, match=f"-o {target}: {target} is a file; name a folder"):
        profile_request(args, argparse.Namespace(world_size=2))
    assert target.read_text() == "mine"
