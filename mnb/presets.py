"""The model presets shipped with mnb: JSON files in ``templates/presets/``, one a model.

Which presets exist (:func:`preset_names`) and what one holds (:func:`preset_fields`, a dict of
:class:`mnb.config.ModelConfig` fields); :func:`mnb.config.load_preset` makes the ModelConfig.
Level 1: json only, below mnb.config.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from mnb.paths import package_data

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


def _presets() -> Traversable:
    return package_data("templates") / "presets"


def preset_names() -> list[str]:
    """Names of the model presets shipped in templates/presets/."""
    return sorted(p.name[: -len(".json")] for p in _presets().iterdir() if p.name.endswith(".json"))


def preset_fields(name: str) -> dict[str, Any]:
    """The ModelConfig fields of preset ``name`` (templates/presets/NAME.json, its description left out);
    ValueError naming the presets there are when there is none of that name."""
    path = _presets() / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown model preset {name!r}; choose from {', '.join(preset_names())}")
    data = json.loads(path.read_text(encoding="utf-8"))
    data.pop("description", None)
    return data
