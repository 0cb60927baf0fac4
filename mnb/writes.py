"""Where mnb writes into a user's folders: refuse what is not its own, swap folders without loss.

Every mnb writer (``mnb.save``, ``mnb.save_hf``, ``%mnb export -o``, the corpus cache, profile
folders) follows the same two rules:

- **A target that is not its own kind is refused** unless the caller says ``overwrite=True``
  (a magic: ``--overwrite``): :func:`check_folder` / :func:`check_file` raise
  :class:`~mnb.errors.OverwriteRefusedError` listing what is there and naming the flag.  An
  empty or missing target, or one holding a complete output of the writer's own kind, needs no
  flag.
- **Only what it recognises as its own is replaced**: a folder's other entries (a user's
  ``notes.txt``, ``sub/``) are moved into the new folder, never deleted.

Folder outputs (checkpoints) are replaced by one atomic swap (:func:`swap`): the new folder is
written complete beside the target (``<path>.tmp-<id>``), then the old one is moved aside
(``<path>.old-<id>``), the new one renamed into place, the user's entries moved over from the
old one, and the old one deleted.  The previous good checkpoint stays until the new one is
complete.  A crash between the two renames leaves only ``.tmp-``/``.old-`` siblings:
:func:`find` (used by every load) reads the newest complete one, and :func:`recover` (called by
the next save) finishes the swap.  Torch-free: both the rank side and the notebook use it.

Where and how is decided once, by one process, before anything is written (:func:`prepare`, a
:class:`Plan` every rank receives): a symlink to a folder is followed (the output goes into the
folder it points to; the link stays); a folder that cannot be renamed (a mount point: a docker
volume, tmpfs, NFS; a folder whose parent is read-only: :func:`unrenamable`) is written *inside*:
into ``<path>/.mnb-tmp-<id>``, whose files are moved into ``<path>`` by :func:`fill` (the old
output's marker leaves first, the new one's arrives last, the old output waits complete in
``<path>/.mnb-old-<id>`` meanwhile), so at every moment a complete output is readable (:func:`find`)
and no incomplete one reads as complete.  A target that cannot be written at all is refused.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mnb.errors import OverwriteRefusedError

logger = logging.getLogger(__name__)

LISTED = 8
"""Entries named in a refusal before ``... and N more``."""


@dataclass(frozen=True)
class Kind:
    """One kind of folder output: what its writer calls it, the names it writes, when it is complete."""

    name: str
    """For messages: ``"mnb checkpoint"``."""
    patterns: tuple[str, ...]
    """``fnmatch`` patterns of the entry names its writer writes (every one of them)."""
    complete: Callable[[Path], bool]
    """Whether a folder holds a complete output of this kind (the marker its writer writes last)."""
    saved_time: Callable[[Path], float] = lambda folder: folder.stat().st_mtime
    """When a complete output was written (which of two left by interrupted saves is newer)."""
    marker: str = ""
    """The file its writer writes last (``marker + ".part"`` first, then renamed); without it, incomplete."""

    def owns(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns)


def _mnb_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / "mnb.json").read_text())
    except (OSError, ValueError):  # missing, a folder, not UTF-8, not JSON
        return None
    return meta if isinstance(meta, dict) else None


def _mnb_checkpoint_complete(folder: Path) -> bool:
    """``mnb.json`` (written last, by a rename) holds a JSON object, and Megatron's ``metadata.json`` is there."""
    return _mnb_meta(folder) is not None and (folder / "metadata.json").is_file()


def _hf_checkpoint_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (
        (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file())


MNB_CHECKPOINT = Kind(
    "mnb checkpoint",
    # mnb.json (written last), Megatron's metadata.json and common.pt, torch.distributed.checkpoint's files
    ("mnb.json", "mnb.json.part", "metadata.json", "common.pt", ".metadata", "*.distcp"),
    _mnb_checkpoint_complete,
    lambda folder: (_mnb_meta(folder) or {}).get("time", 0),  # mnb.json's "time"
    marker="mnb.json")
HF_CHECKPOINT = Kind(
    "Hugging Face checkpoint",
    # config.json (written last by mnb.save_hf), the weights, and the tokenizer files it copies
    ("config.json", "config.json.part", "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
     "part-r*.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
     "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
     "tokenizer.model", "chat_template.jinja", "chat_template.json"),
    _hf_checkpoint_complete, marker="config.json")

PEFT_ADAPTER = Kind(
    "peft adapter",
    # adapter_config.json (written last by mnb.save_adapter) and the weights; peft's README.md beside them
    ("adapter_config.json", "adapter_config.json.part", "adapter_model.safetensors", "adapter_model.bin", "README.md"),
    lambda folder: (folder / "adapter_config.json").is_file()
    and (folder / "adapter_model.safetensors").is_file(), marker="adapter_config.json")


def listing(folder: Path, names: list[str] | None = None) -> str:
    """``notes.txt, sub/ (2 entries)``: the entries of ``folder`` (or ``names``), folders with ``/``."""
    names = sorted(os.listdir(folder)) if names is None else sorted(names)
    shown = [n + "/" if (folder / n).is_dir() else n for n in names[:LISTED]]
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return f"{', '.join(shown)}{more} ({len(names)} entr{'y' if len(names) == 1 else 'ies'})"


def check_folder(path: Path, kind: Kind, *, overwrite: bool, writer: str, flag: str = "overwrite=True") -> None:
    """Raise :class:`OverwriteRefusedError` unless ``path`` may take a ``kind`` output.

    Allowed: missing, an empty folder, a complete ``kind`` output (its other entries are kept),
    or anything that is a folder when ``overwrite``.  A file is never replaced by a folder.
    ``writer`` (``"mnb.save"``) and ``flag`` name the call and the way to allow it in the message.
    """
    if not path.exists():
        return
    if not path.is_dir():
        raise OverwriteRefusedError(f"{writer}: {path} is a file, not a folder; choose another path "
                                    "(mnb does not replace a file with a folder)")
    entries = [n for n in os.listdir(path)  # not the user's: an ext4 volume's own, what a save into it left
               if not (n == "lost+found" and is_mount_point(path) or n.startswith((INSIDE_TMP, INSIDE_OLD)))]
    if not entries or kind.complete(path) or overwrite:
        return
    theirs = [n for n in entries if not kind.owns(n)]
    raise OverwriteRefusedError(
        f"{writer}: {path} is not empty and holds no {kind.name}: {listing(path)}. Choose a new or "
        f"empty folder, or pass {flag} to write the {kind.name} there (only the {kind.name}'s own files "
        f"are replaced" + (f"; {listing(path, theirs)} stay" if theirs else "") + ")")


def check_file(path: Path, is_own: Callable[[Path], bool], *, overwrite: bool, writer: str, what: str,
               flag: str = "overwrite=True") -> None:
    """Raise :class:`OverwriteRefusedError` unless the file ``path`` may be (re)written.

    Allowed: missing, empty, one ``is_own`` recognises as this writer's ``what``, or any file when
    ``overwrite``.  A folder is never replaced by a file."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_dir():
        raise OverwriteRefusedError(f"{writer}: {path} is a folder ({listing(path)}), not a file; "
                                    f"name a file to write the {what} to")
    if overwrite or path.stat().st_size == 0 or is_own(path):
        return
    raise OverwriteRefusedError(f"{writer}: {path} exists ({path.stat().st_size} bytes) and is not {what}; "
                                f"choose another file, or pass {flag} to replace it")


# -- the plan: where and how, decided once ---------------------------------------------------


INSIDE_TMP, INSIDE_OLD = ".mnb-tmp-", ".mnb-old-"
"""Name prefixes of the folders a save into a folder that cannot be renamed keeps inside it."""


@dataclass(frozen=True)
class Plan:
    """Where a folder output is written and how it is put in place; one process decides (:func:`prepare`)
    and every writer receives the same plan."""

    path: Path
    """The folder the output ends up in: the one named, its symlinks resolved."""
    tmp: Path
    """Where the writers write it: ``<path>.tmp-<id>`` beside it, or ``<path>/.mnb-tmp-<id>`` inside it."""
    inside: str = ""
    """Why ``tmp`` is inside ``path`` (``path`` cannot be renamed: "it is a mount point", ...); "" for a swap."""


def is_mount_point(path: Path) -> bool:
    """``os.path.ismount``, or listed in ``/proc/self/mountinfo`` (a bind mount of a folder of the same disk)."""
    if os.path.ismount(path):
        return True
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:  # not Linux
        return False
    escaped = str(path).replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011").replace("\n", "\\012")
    return any(len(fields) > 4 and fields[4] == escaped for fields in (line.split(" ") for line in lines))


def unrenamable(path: Path) -> str:
    """Why the existing folder ``path`` cannot be renamed (then mnb writes inside it), or "" when it can."""
    if is_mount_point(path):
        return "it is a mount point"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return f"its parent {path.parent} is not writable"
    return ""


def prepare(path: Path, kind: Kind, *, overwrite: bool, writer: str) -> tuple[Plan | None, tuple[str, str] | None]:
    """One process (rank 0), before anything is written: follow symlinks, finish an interrupted save, check
    that ``path`` may take a ``kind`` output (:func:`check_folder`), choose where to write and create that
    folder.  Returns ``(plan, None)`` or ``(None, problem)``, plain data every rank receives (a broadcast)
    and hands to :func:`agree`, so that all of them raise the same error or write by the same plan."""
    real = Path(os.path.realpath(path))  # a link to a folder: write into that folder, keep the link
    tmp, inside = tmp_path(real, uuid.uuid4().hex[:12]), ""
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        recover(real, kind)
        check_folder(real, kind, overwrite=overwrite, writer=writer)
        inside = unrenamable(real) if real.is_dir() else ""
        if inside:
            tmp = real / f"{INSIDE_TMP}{tmp.name.rsplit('-', 1)[-1]}"
        tmp.mkdir()
    except OverwriteRefusedError as exc:
        return None, ("refused", str(exc))
    except OSError as exc:
        where = (f"into {real} ({inside}, so mnb writes inside it)" if inside
                 else f"{tmp.name} beside {real}" if real.is_dir() else f"{real}")
        fix = ("remount it read-write, or choose a folder on a writable file system" if exc.errno == errno.EROFS
               else "choose a folder this user can write to (a new folder needs a writable parent; a mount "
               "point or a folder whose parent is read-only must be writable itself)")
        return None, ("os", f"{writer}: cannot write {where}: {exc.strerror or exc}; nothing was written. "
                      f"{fix[0].upper()}{fix[1:]}")
    if real != path:
        logger.info("%s is a link: writing into %s", path, real)
    if inside:
        logger.info("%s cannot be renamed (%s): writing inside it", real, inside)
    return Plan(real, tmp, inside), None


def agree(prepared: tuple[Plan | None, tuple[str, str] | None]) -> Plan:
    """The plan :func:`prepare` returned, or its problem raised (the same on every rank that received it)."""
    plan, problem = prepared
    raise_problem(problem)
    assert plan is not None
    return plan


def raise_problem(problem: tuple[str, str] | None) -> None:
    """Raise what :func:`prepare` found (the same on every rank that received it), or nothing."""
    if problem is not None:
        kind, message = problem
        raise OverwriteRefusedError(message) if kind == "refused" else OSError(message)


def finish(plan: Plan, kind: Kind) -> None:
    """Put the complete output in ``plan.tmp`` at ``plan.path`` (:func:`swap`, or :func:`fill` inside);
    one process, after every writer finished.  On failure the old output is put back and ``plan.tmp`` removed."""
    try:
        fill(plan.tmp, plan.path, kind) if plan.inside else swap(plan.tmp, plan.path, kind)
    except BaseException:
        if plan.inside:
            _undo_fill(plan, kind)
        discard(plan)  # a swap that failed at its first rename changed nothing; at its second, recover() undoes it
        raise


def _undo_fill(plan: Plan, kind: Kind) -> None:
    """After a failed :func:`fill`: the new output's files out of ``plan.path``, the old one's back in."""
    path, old = plan.path, plan.path / f"{INSIDE_OLD}{plan.tmp.name.rsplit('-', 1)[-1]}"
    try:
        if not (plan.tmp / kind.marker).exists():  # the new output was moving in (its marker moves first)
            for name in os.listdir(path):
                if kind.owns(name):
                    _remove(path / name)
        if old.is_dir():  # the old output, all or part of it: back in, its marker last
            part = old / f"{kind.marker}.part"
            if (old / kind.marker).exists():
                os.replace(old / kind.marker, part)
            for name in os.listdir(old):
                if name != part.name:
                    os.replace(old / name, path / name)
            if part.exists():
                os.replace(part, path / kind.marker)
            old.rmdir()
    except OSError as exc:  # find() still reads a complete copy; the next save's recover() finishes
        logger.warning("could not put the old output back into %s (%s); the next save will", path, exc)


def discard(plan: Plan) -> None:
    """Remove what a failed save wrote (``plan.tmp``); the previous output is untouched."""
    shutil.rmtree(plan.tmp, ignore_errors=True)


# -- the atomic swap ------------------------------------------------------------------------


def tmp_path(path: Path, token: str) -> Path:
    return path.with_name(f"{path.name}.tmp-{token}")


def _siblings(path: Path, tag: str) -> list[Path]:
    return sorted(path.parent.glob(f"{glob_escape(path.name)}.{tag}-*"))


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def find(path: Path, kind: Kind) -> Path | None:
    """The complete ``kind`` output for ``path``: itself, or what an interrupted swap left; None if none.

    A swap that died between "move the old one aside" and "rename the new one in" leaves
    ``path.tmp-<id>`` (complete) and ``path.old-<id>``: the new one wins; among several,
    the newest by ``kind.saved_time``.  Reads only: loads use it on
    every rank at once; the next save renames (:func:`recover`).
    """
    path = Path(os.path.realpath(path))  # through a link: where the save wrote
    if kind.complete(path):
        return path
    if path.is_dir():  # written inside (a mount point): a fill stopped midway left a complete copy inside
        return _newest(path, [p for p in _inside(path, INSIDE_TMP) + _inside(path, INSIDE_OLD) if kind.complete(p)],
                       kind, INSIDE_TMP)
    if path.exists():
        return None
    candidates = [p for p in _siblings(path, "tmp") + _siblings(path, "old") if kind.complete(p)]
    return _newest(path, candidates, kind, path.name + ".tmp-")


def _newest(path: Path, candidates: list[Path], kind: Kind, new_prefix: str) -> Path | None:
    """The new copy (``new_prefix``) before an old one; among several, the newest by ``kind.saved_time``."""
    if not candidates:
        return None
    return max(candidates, key=lambda p: (p.name.startswith(new_prefix), kind.saved_time(p)))


def _inside(path: Path, prefix: str) -> list[Path]:
    return sorted(path.glob(f"{prefix}*"))


def recover(path: Path, kind: Kind) -> None:
    """Finish a swap a crash interrupted, then remove what interrupted saves left behind.

    With ``path`` missing: the newest complete ``.tmp-``/``.old-`` sibling is renamed into
    place, else the newest ``.old-`` one (whatever it held: it was the target before).  Every
    ``.old-`` sibling's entries that ``kind`` does not own move into ``path`` before it is
    deleted; ``.tmp-`` siblings hold only the writer's own files and are deleted.
    """
    if not path.exists():
        found = find(path, kind)
        olds = _siblings(path, "old")
        if found is None and olds:
            found = max(olds, key=lambda p: p.stat().st_mtime)
        if found is not None:
            os.replace(found, path)
            logger.warning("restored %s from %s (a save stopped mid-swap)", path, found.name)
    for old in _siblings(path, "old"):
        _keep_theirs(old, path, kind)
    for tmp in _siblings(path, "tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    if path.is_dir():
        _recover_inside(path, kind)


def _recover_inside(path: Path, kind: Kind) -> None:
    """Finish a :func:`fill` a crash interrupted, then remove the ``.mnb-tmp-``/``.mnb-old-`` folders inside.

    ``<marker>.part`` in ``path`` means the new output's files were moving in (its marker moved first): the
    rest moves in and the marker is named.  Else, ``path`` incomplete: its own entries go and the newest
    complete copy inside moves in.
    """
    part = path / f"{kind.marker}.part"
    news = [p for p in _inside(path, INSIDE_TMP) if not (p / kind.marker).exists()]
    if kind.marker and part.is_file() and news:
        _move_entries(news[-1], path)
        os.replace(part, path / kind.marker)
        logger.warning("finished the save into %s that stopped while its files moved in", path)
    elif not kind.complete(path):
        found = find(path, kind)
        if found is not None:
            for name in os.listdir(path):
                if kind.owns(name):
                    _remove(path / name)
            _move_in(found, path, kind)
            logger.warning("restored %s from %s (a save stopped midway)", path, found.name)
    for inner in _inside(path, INSIDE_TMP) + _inside(path, INSIDE_OLD):
        shutil.rmtree(inner, ignore_errors=True)


def _remove(entry: Path) -> None:
    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _move_entries(source: Path, path: Path) -> None:
    for name in os.listdir(source):
        if (path / name).is_dir() and not (path / name).is_symlink():
            shutil.rmtree(path / name)
        os.replace(source / name, path / name)


def _move_in(new: Path, path: Path, kind: Kind) -> None:
    """Move the complete output ``new`` (a folder inside ``path``) into ``path``: its marker leaves ``new``
    first (as ``<marker>.part`` in ``path``) and is named last, so neither reads as complete meanwhile."""
    part = path / f"{kind.marker}.part"
    os.replace(new / kind.marker, part)
    _move_entries(new, path)
    os.replace(part, path / kind.marker)
    new.rmdir()


def fill(tmp: Path, path: Path, kind: Kind) -> None:
    """Put the complete output ``tmp`` (``path/.mnb-tmp-<id>``) into ``path`` itself, which cannot be renamed.

    The old output's files move into ``path/.mnb-old-<id>`` (its marker first, as ``<marker>.part``,
    named last there), then the new one's move in (:func:`_move_in`); then the old one is deleted.
    Entries ``kind`` does not own are never touched.  A crash at any point leaves one complete copy
    that :func:`find` reads (the new one until its marker moves, then the old one) and :func:`recover`
    finishes.
    """
    token = tmp.name.rsplit("-", 1)[-1]
    old = path / f"{INSIDE_OLD}{token}"
    own = [n for n in os.listdir(path) if kind.owns(n)]
    if own:
        old.mkdir()
        part = old / f"{kind.marker}.part"
        if kind.marker in own:
            os.replace(path / kind.marker, part)  # first: path no longer reads as complete
        for name in own:
            if name == f"{kind.marker}.part":  # a stray one; the old output's marker waits under this name
                _remove(path / name)
            elif name != kind.marker:
                os.replace(path / name, old / name)
        if part.exists():
            os.replace(part, old / kind.marker)  # last: the old output, complete, waits here
    _move_in(tmp, path, kind)
    shutil.rmtree(old, ignore_errors=True)


def swap(tmp: Path, path: Path, kind: Kind) -> None:
    """Put the complete folder ``tmp`` at ``path``, keeping the entries of ``path`` that ``kind`` does not own.

    One process (rank 0) calls it, after every writer finished ``tmp``.  ``tmp``'s name is
    ``path.tmp-<id>``; the old folder goes to ``path.old-<id>`` while the new one is renamed in.
    """
    token = tmp.name.rsplit("-", 1)[-1]
    old = path.with_name(f"{path.name}.old-{token}")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        _keep_theirs(old, path, kind)


def _keep_theirs(old: Path, path: Path, kind: Kind) -> None:
    """Move ``old``'s entries that ``kind`` does not own (and ``path`` lacks) into ``path``; then delete ``old``.

    An entry ``path`` already has under the same name (the new output wrote it) is the writer's own.
    """
    if not old.is_dir():
        return
    for name in os.listdir(old):
        if not kind.owns(name) and not (path / name).exists() and not (path / name).is_symlink():
            os.replace(old / name, path / name)
    shutil.rmtree(old, ignore_errors=True)
