"""``%mnb run`` (a torchrun script on the warm ranks) and how a request's end is shown.

Kept out of :mod:`mnb.notebook.magics` (parsing and dispatch only there): ``%mnb run`` and
``--isolated``, plus what ``%%megatron``, ``%mnb run`` and ``%mnb debug`` share: the kernel's
cwd and environment changes for the ranks, and a refused or interrupted request as one line.
Torch-free.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Any, Iterator

from IPython.core.error import UsageError

from mnb.controller import Pool, last_run
from mnb.controller.kernel_context import kernel_context
from mnb.controller.repair import layout_kept
from mnb.errors import RequestRefused, interrupted
from mnb.notebook.parsers import parse_ranks
from mnb.units import cwd_note


def kernel_changes(pool: Pool) -> dict[str, Any]:
    """The kernel's cwd and environment changes since the pool started, for the ranks' cells and scripts."""
    return kernel_context(pool.environ_at_start)


@contextlib.contextmanager
def pool_request(what: str) -> Iterator[None]:
    """How ``%%megatron`` and ``%mnb run`` show a request's end: a refusal as a usage error,
    an interrupt as one line (the pool's own account when it gave one)."""
    try:
        yield
    except RequestRefused as exc:
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt as exc:
        if hasattr(exc, "_render_traceback_"):  # the pool's one-line account of the interrupt
            raise
        raise interrupted(f"interrupted in the notebook kernel after the ranks had finished the {what}") from None


def require_pool(pool: Pool | None) -> Pool:
    """``pool``, for a command that needs one; a usage error that says how to start one when none runs."""
    if pool is None:
        raise UsageError("no pool is running; start one with %mnb start")
    return pool


def run_command(args: argparse.Namespace, pool: Pool | None) -> None:
    pool = require_pool(pool)
    ranks = parse_ranks(args.ranks, pool.world_size)
    if not os.path.isfile(os.path.expanduser(args.script)):
        raise UsageError(f"no script {args.script!r}{cwd_note(args.script)}; "
                         "%mnb run's own options come before the script, its arguments after it")
    if args.isolated:
        run_isolated(pool, args, ranks)
    else:
        with pool_request("script"):
            pool.run_script(args.script, args.args, ranks=ranks, timeout=args.timeout, grace=args.grace,
                            kernel=kernel_changes(pool))
    if pool.last_cell_records:
        print(last_run().summary())


def run_isolated(pool: Pool, args: argparse.Namespace, ranks: list[int] | None) -> None:
    """``%mnb run --isolated``: a restart of the pool before and after the script (the layout stays, as
    every restart keeps it)."""

    def fresh() -> float:
        t0 = time.perf_counter()
        pool.restart()
        return time.perf_counter() - t0

    before = fresh()
    print(f"mnb: --isolated: fresh rank processes for the script ({pool.world_size} ranks restarted in "
          f"{before:.1f} s; they restart again after it; {layout_kept(pool.layout)}; a plain %mnb run needs "
          "no restart)")
    try:
        with pool_request("script"):
            pool.run_script(args.script, args.args, ranks=ranks, timeout=args.timeout, grace=args.grace,
                            kernel=kernel_changes(pool))
    finally:
        after = fresh()
        print(f"mnb: --isolated: the pool restarted after the script in {after:.1f} s")
