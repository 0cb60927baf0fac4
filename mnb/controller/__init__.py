"""Notebook side of mnb: the pool of ranks and what it gathered.

Never imports torch or Megatron (a test checks ``sys.modules``).
"""

from __future__ import annotations

from typing import Any

from mnb.controller.pool import Pool
from mnb.controller.registry import current_pool, last_run, set_current_pool

__all__ = ["Pool", "pool", "last_run", "current_pool", "set_current_pool"]


def pool() -> Pool:
    """The running pool (started by ``%mnb start``); raises PoolError if there is none.

    ``pool.run(code, ranks=None, timeout=None)``, ``pool.push({"name": value})``,
    ``pool.pull("name") -> {rank: value}``, ``pool.status()``, ``pool.restart()``.
    """
    found: Any = current_pool(required=True)
    return found
