"""What the notebook kernel tells the ranks about itself with each request: its directory
and the environment variables it changed since the pool started.

The ranks inherited the kernel's ``os.environ`` when they were launched; ``%env FOO=1``
or ``os.environ["FOO"] = "1"`` in the notebook afterwards changes only the kernel.  The
magics send the difference (``%%megatron`` cells: applied on the ranks and kept; ``%mnb
run``: applied for the script, with the kernel's cwd, and undone after it --
``mnb.worker.sandbox``).  Torch-free: notebook side.
"""

from __future__ import annotations

import os
from typing import Any, Mapping


def environ_changes(since: Mapping[str, str], now: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{"set": {name: value}, "unset": [name]}``: how ``now`` (default ``os.environ``) differs from ``since``."""
    now = os.environ if now is None else now
    changed = {k: v for k, v in now.items() if since.get(k) != v}
    removed = sorted(k for k in since if k not in now)
    return {"set": changed, "unset": removed}


def kernel_context(environ_at_start: Mapping[str, str], *, cwd: bool = True) -> dict[str, Any]:
    """The request header's ``kernel`` field: the kernel's cwd (unless ``cwd=False``: the ranks stay
    where they are) and its environment changes."""
    context: dict[str, Any] = {"environ": environ_changes(environ_at_start)}
    if cwd:
        context["cwd"] = os.getcwd()
    return context
