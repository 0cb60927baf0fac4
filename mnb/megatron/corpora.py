"""Where training text comes from: corpus presets, files, folders, globs; the corpus cache.

    resolve_text_files("stdlib")            # Python's own standard library sources
    resolve_text_files("notes/")            # every text file below a folder, sorted
    resolve_text_files("notes/**/*.md")     # a glob (recursive)

A folder's text files are all files below it except hidden ones (a name starting with
``.``, also folders), ``__pycache__`` and binary files (a NUL byte in their first 8 KiB):
text is chosen by content, not by suffix. :mod:`mnb.megatron.data` tokenizes them.
"""

from __future__ import annotations

import glob as globlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, Union

from mnb.units import cwd_note

DataSpec = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]
TEXT_PROBE_BYTES = 8192
"""A file with a NUL byte in its first this many bytes is binary, never read as text."""


def cache_dir() -> Path:
    """mnb's cache folder (:func:`mnb.paths.cache_dir`: ``$MNB_CACHE``, else ``$XDG_CACHE_HOME/mnb``, else ``~/.cache/mnb``)."""
    from mnb.paths import cache_dir as config_cache_dir

    return config_cache_dir()


def stdlib_files(max_bytes: int) -> list[Path]:
    """The standard library's ``.py`` files, sorted by path, until ``max_bytes`` is reached.

    Skips ``site-packages``, test suites (``test``/``tests``, which hold deliberately
    broken files), generated tables (``encodings``, ``pydoc_data``), bundled tools
    (``idlelib``, ``lib2to3``, ``ensurepip``) and ``__pycache__``. Deterministic for
    a given Python build.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test",
            "encodings", "pydoc_data", "idlelib", "lib2to3", "ensurepip", "turtledemo"}
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames
                       if d not in skip and not d.startswith((".", "config-"))]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    chosen, total = [], 0
    for path in found:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


@dataclass(frozen=True)
class Corpus:
    """A named corpus: a function listing its files, and what it is."""

    name: str
    description: str
    files: Callable[[], list[Path]]


CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in (
        Corpus("stdlib", "Python standard-library sources, first 4 MiB by sorted path",
               lambda: stdlib_files(4 << 20)),
        Corpus("stdlib-small", "Python standard-library sources, first 512 KiB by sorted path",
               lambda: stdlib_files(512 << 10)),
    )
}
"""Corpus presets accepted as ``data=`` by name."""


def _is_text_file(path: Path) -> bool:
    with open(path, "rb") as fh:
        return b"\0" not in fh.read(TEXT_PROBE_BYTES)


def resolve_text_files(spec: DataSpec) -> list[Path]:
    """Files named by a corpus preset, a file, a folder, a glob, or a list of those."""
    if isinstance(spec, (list, tuple)):
        return [f for item in spec for f in resolve_text_files(item)]
    text = os.fspath(spec)
    if text in CORPORA:
        return CORPORA[text].files()
    path = Path(text).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
            files.extend(Path(dirpath, f) for f in filenames if not f.startswith("."))
        files.sort(key=lambda p: p.relative_to(path).as_posix())
        texts = [f for f in files if f.is_file() and _is_text_file(f)]
        if not texts:
            raise FileNotFoundError(
                f"data folder {text!r} holds no text files (hidden files aside, {len(files)} "
                "file(s), all binary): a text file is any non-hidden file without a NUL byte in "
                f"its first {TEXT_PROBE_BYTES} bytes"
            )
        return texts
    if globlib.has_magic(text):
        matches = sorted(globlib.glob(os.path.expanduser(text), recursive=True))
        files = [Path(m) for m in matches if Path(m).is_file()]
        if files:
            return files
        raise FileNotFoundError(f"data glob {text!r} matches no files{cwd_note(text)}")
    raise FileNotFoundError(
        f"data {text!r} does not exist{cwd_note(text)}: expected 'mock', a corpus preset "
        f"({', '.join(CORPORA)}), a text file, a folder, a glob, or a Megatron "
        ".bin/.idx prefix"
    )
