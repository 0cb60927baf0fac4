"""The launch templates (``templates/launch/*.sbatch``) filled in: one renderer for everyone.

Two sides render them: the Slurm launcher (``mnb.controller.slurm``: ``pool.sbatch``, the job
of a ``%mnb start --slurm`` pool) and the export (``mnb.megatron_lm.exports``: ``megatron-lm.sbatch`` for
``%mnb export slurm``).  The controller never imports the export (docs/architecture.md, the
layering table), so the renderer lives below both; it reads only the package's data.
"""

from __future__ import annotations

import re
from typing import Any

from mnb.paths import package_data

PLACEHOLDER = re.compile(r"@([a-z_]+)@")
"""``@key@`` rather than ``$key`` or ``{key}``: the templates are bash, full of both."""


def render_template(name: str, values: dict[str, Any]) -> str:
    """Fill ``templates/launch/NAME``: ``@key@`` placeholders, each of which must be given.

    e.g. ``render_template("pool.sbatch", {"nodes": 2, ...})``; a placeholder without a value is
    a ``KeyError`` naming every one missing.
    """
    text = (package_data("templates") / "launch" / name).read_text(encoding="utf-8")
    missing = sorted({m for m in PLACEHOLDER.findall(text) if m not in values})
    if missing:
        raise KeyError(f"template {name} needs values for {missing}")
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), text)
