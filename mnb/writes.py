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
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
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
    lambda folder: (_mnb_meta(folder) or {}).get("time", 0))  # mnb.json's "time"
HF_CHECKPOINT = Kind(
    "Hugging Face checkpoint",
    # config.json (written last by mnb.save_hf), the weights, and the tokenizer files it copies
    ("config.json", "config.json.part", "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
     "part-r*.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
     "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
     "tokenizer.model", "chat_template.jinja", "chat_template.json"),
    _hf_checkpoint_complete)

PEFT_ADAPTER = Kind(
    "peft adapter",
    # adapter_config.json (written last by mnb.save_adapter) and the weights; peft's README.md beside them
    ("adapter_config.json", "adapter_config.json.part", "adapter_model.safetensors", "adapter_model.bin", "README.md"),
    lambda folder: (folder / "adapter_config.json").is_file()
    and (folder / "adapter_model.safetensors").is_file())


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
    entries = os.listdir(path)
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


# -- the atomic swap ------------------------------------------------------------------------


def prepare(path: Path, tmp: Path, kind: Kind, *, overwrite: bool, writer: str) -> tuple[str, str] | None:
    """One process (rank 0), before anything is written: finish an interrupted swap, check that ``path``
    may take a ``kind`` output (:func:`check_folder`), create ``tmp``.  Returns None, or the problem
    as plain data that every rank raises alike through :func:`raise_problem` (after a broadcast)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        recover(path, kind)
        check_folder(path, kind, overwrite=overwrite, writer=writer)
        tmp.mkdir()
    except OverwriteRefusedError as exc:
        return ("refused", str(exc))
    except OSError as exc:
        return ("os", f"{writer}: cannot prepare {path} (and {tmp.name} beside it): {exc}")
    return None


def raise_problem(problem: tuple[str, str] | None) -> None:
    """Raise what :func:`prepare` found (the same on every rank that received it), or nothing."""
    if problem is not None:
        kind, message = problem
        raise OverwriteRefusedError(message) if kind == "refused" else OSError(message)


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
    if kind.complete(path):
        return path
    if path.exists():
        return None
    candidates = [p for p in _siblings(path, "tmp") + _siblings(path, "old") if kind.complete(p)]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (p.name.startswith(path.name + ".tmp-"), kind.saved_time(p)))


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
