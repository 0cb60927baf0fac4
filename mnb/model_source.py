"""What a ``model`` argument names on the notebook side: a preset, or a Hugging Face checkpoint.

The estimators, ``%mnb plan --model``, ``mnb.explorer(model=...)`` and ``%mnb export --model``
take a preset name (``"llama-8b"``, ``templates/presets/``), a Hugging Face checkpoint folder
(anything holding a ``config.json``; read by :func:`mnb.hf_config`, json only, no weights), that
``config.json`` itself, a field dict or a :class:`ModelConfig`::

    resolve_model("llama-8b")                        # the preset
    resolve_model("/models/Llama-3.2-1B")            # its config.json, through mnb.hf_config
    resolve_model("/models/Llama-3.2-1B", num_layers=4)

A string is a checkpoint when it names an existing folder with a ``config.json`` or an existing
``.json`` file; one that looks like a path (``/``, ``~``, ``.``) but is neither is refused as a
path, not as an unknown preset. Kept apart from :mod:`mnb.config` (which :mod:`mnb.hf_config`
imports) so neither imports the other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mnb.config import ModelConfig, model_config
from mnb.units import cwd_note


def checkpoint_folder(model: Any) -> Path | None:
    """The Hugging Face checkpoint folder ``model`` names (absolute), or None for anything else."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.is_file() and path.suffix == ".json":
        return path.resolve().parent
    return None


def _looks_like_path(text: str) -> bool:
    return os.sep in text or text.startswith(("~", ".")) or text.endswith(".json")


def resolve_model(model: str | os.PathLike | ModelConfig | dict, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` from a preset, a checkpoint folder or its config.json, fields or a config.

    ValueError, naming the path or the preset list, for anything else.
    """
    from mnb.hf_config import hf_config

    if checkpoint_folder(model) is not None:
        return hf_config(model, **overrides)
    if isinstance(model, os.PathLike) or (isinstance(model, str) and _looks_like_path(model)):
        path = Path(model).expanduser()
        where = "is a folder without config.json" if path.is_dir() else "does not exist"
        raise ValueError(f"model {os.fspath(model)!r} {where}{cwd_note(path)}: pass a Hugging Face checkpoint folder "
                         "(with its config.json) or a preset name")
    return model_config(model, **overrides)


def tokenizer_folder(model: Any) -> str | None:
    """The checkpoint folder of ``model`` when it holds a ``tokenizer.json`` (what the ranks read), else None."""
    folder = checkpoint_folder(model)
    return str(folder) if folder is not None and (folder / "tokenizer.json").is_file() else None


def tokenizer_vocab_size(folder: str | os.PathLike) -> int | None:
    """Ids in ``folder/tokenizer.json`` (its model's vocabulary and added tokens), read as JSON; None if unreadable."""
    import json

    try:
        data = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = (data.get("model") or {}).get("vocab") or {}
        ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]  # Unigram: a list
        ids += [t["id"] for t in data.get("added_tokens") or []]
        return max(int(i) for i in ids) + 1 if ids else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
