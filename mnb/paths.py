"""Where mnb's own files are: the data folders it ships and its cache folder.

Three rules, each stated once: :func:`package_data` finds ``templates/`` (presets, launch scripts) and
``kernels/`` (the kernelspec) in a wheel or a source checkout; :func:`cache_dir` is the one cache folder
(tokenised corpora, dataset indices, compiled kernels); :func:`in_mnb` tells mnb's own source files.  Level 1: imports nothing of mnb.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


def package_data(folder: str) -> Traversable:
    """A data folder shipped with mnb: ``"templates"`` (presets) or ``"kernels"`` (the kernelspec).

    Their source lives at the top of the repository; the wheel maps them into the
    package (``mnb/templates``, ``mnb/kernels``; see pyproject.toml), where
    :mod:`importlib.resources` finds them.  A source checkout (an editable
    install, or the repository on ``sys.path``) has them beside ``mnb/`` instead.
    """
    packaged = resources.files("mnb") / folder
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / folder).is_dir():
        return checkout / folder
    raise FileNotFoundError(
        f"mnb's {folder}/ folder is missing: neither {packaged} (an installed wheel) nor "
        f"{checkout / folder} (a source checkout) exists; reinstall mnb"
    )


PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
"""The ``mnb`` package's folder, as frames name their files (not symlink-resolved), with a trailing separator."""


def in_mnb(filename: str) -> bool:
    """Whether a frame's file is mnb's own: the one rule for tracebacks, stacks and warnings that point past
    mnb's frames to the user's."""
    return filename.startswith(PACKAGE_DIR)


def cache_dir() -> Path:
    """mnb's cache folder: ``$MNB_CACHE``, else ``$XDG_CACHE_HOME/mnb``, else ``~/.cache/mnb``.

    One rule for every cache (tokenised corpora and dataset indices on the ranks, the
    compiled kernels a pool's CUDA ranks keep); with several nodes it must be shared storage.
    """
    if os.environ.get("MNB_CACHE"):
        return Path(os.environ["MNB_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "mnb"
