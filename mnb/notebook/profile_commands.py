"""The notebook's profiling commands: ``%%megatron --profile`` requests and ``%mnb profile``.

Kept out of :mod:`mnb.notebook.magics` (parsing only there): what a profiled cell asks of the ranks,
how its folder becomes ``mnb.last_profile`` after the cell, and listing, opening and
deleting the folders.  Torch-free.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError

from mnb.profile_steps import parse_steps
from mnb.notebook.parsers import parse_ranks
from mnb.notebook.profiles import Profile, delete_profile, last_profile, list_profiles, set_last_profile


def profile_request(args: argparse.Namespace, pool: Any) -> dict[str, Any] | None:
    """The rank side's ``{"dir", "steps", "ranks", "memory"}`` of ``--profile``; None without it."""
    if args.profile is None:
        if args.profile_ranks or args.output or args.memory:
            raise UsageError("--profile-ranks, --memory and -o only apply with --profile")
        return None
    try:
        steps = args.profile if parse_steps(args.profile) else None
    except ValueError as exc:
        raise UsageError(f"--profile: {exc}") from None
    ranks = parse_ranks(args.profile_ranks, pool.world_size, "--profile-ranks")
    root = Path(args.output).expanduser() if args.output else pool.workdir() / "profiles"
    if root.exists() and not root.is_dir():
        raise UsageError(f"-o {args.output}: {root} is a file; name a folder (the profile goes into a new "
                         "profile-DATE-TIME folder inside it)")
    folder = root / time.strftime("profile-%Y%m%d-%H%M%S")
    while folder.exists():
        folder = folder.with_name(folder.name + "-1")
    return {"dir": str(folder.resolve()), "steps": steps, "ranks": ranks, "memory": bool(args.memory)}


def take_profile(folder: str | None) -> Profile | None:
    """After a cell: merge its profile into ``mnb.last_profile``; None when the cell profiled nothing.

    ``folder``: the one the ranks' replies name (``Pool.last_cell_profile``: the ``--profile`` folder, or
    the cell's own that ``mnb.train(profile=...)`` wrote), else the ``--profile`` folder asked for (a cell
    whose ranks did not reply).  A refusal (too big) is printed."""
    if folder is None:
        return None
    try:
        profile = Profile(folder)
    except FileNotFoundError:
        return None
    except ValueError as exc:
        print(exc)
        return None
    set_last_profile(profile)
    return profile


def run_profile_command(args: argparse.Namespace, pool: Any) -> None:
    """``%mnb profile [list|open|delete] [FOLDER|all]``."""
    root = pool.workdir() / "profiles" if pool is not None else None
    last = last_profile()
    if args.action == "list":
        found = list_profiles(root) if root is not None and root.is_dir() else []
        if last is not None and str(last.folder) not in {f["path"] for f in found}:
            found.append({"path": str(last.folder), "ranks": len(last.ranks), "bytes": last.trace_bytes})
        if not found:
            print("no profiles yet; run a cell with %%megatron --profile")
        for item in found:
            print(f"{item['path']}  ({item['ranks']} rank(s), {item['bytes'] / 2**20:.1f} MiB)")
        return
    if args.action == "delete" and args.target == "all":
        for item in list_profiles(root) if root is not None and root.is_dir() else []:
            delete_profile(item["path"])
        set_last_profile(None)
        print(f"deleted every profile under {root}")
        return
    folder = Path(args.target).expanduser() if args.target else (last.folder if last is not None else None)
    if folder is None:
        raise UsageError("no profile yet: run a cell with %%megatron --profile, or name a folder")
    if args.action == "open":
        profile = last if last is not None and folder == last.folder else Profile(folder)
        print(f"{profile.path}\nopen it in https://ui.perfetto.dev (Open trace file) or chrome://tracing; "
              f"per-rank traces for Holistic Trace Analysis: {profile.trace_dir}")
        return
    try:
        kept = delete_profile(folder)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if last is not None and folder == last.folder:
        set_last_profile(None)
    print(f"deleted {folder}" if not kept else
          f"deleted the profile in {folder}; kept what mnb did not write there: {', '.join(kept)}")
