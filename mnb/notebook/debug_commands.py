"""``%mnb stacks`` and ``%mnb debug``: where the ranks stand, and pdb where one failed.

Kept out of :mod:`mnb.notebook.magics` (parsing and dispatch only there).  The post-mortem itself runs
on the rank (``mnb/worker/debugging.py``) with its prompts through the notebook's stdin
(``mnb/controller/stdin.py``).  Torch-free.
"""

from __future__ import annotations

import argparse

from IPython.core.error import UsageError

from mnb.controller import Pool
from mnb.notebook.run_commands import pool_request, require_pool


def stacks_command(args: argparse.Namespace, pool: Pool | None) -> None:
    print(require_pool(pool).stacks_report())


def debug_command(args: argparse.Namespace, pool: Pool | None) -> None:
    pool = require_pool(pool)
    if args.rank is not None and not 0 <= args.rank < pool.world_size:
        raise UsageError(f"%mnb debug {args.rank}: no such rank in world size {pool.world_size}")
    with pool_request("post-mortem"):
        pool.debug(args.rank)
