"""The session's shared CPU pools (one of 2 ranks, one of 4) and their reset between modules and tests.

One module holds them, imported as ``tests.shared_pools`` from both conftest files and the tests
(pytest imports ``tests/conftest.py`` under its own name too, so state kept there would exist twice).
"""

from __future__ import annotations

_SHARED: dict[int, object] = {}
"""The session's shared pools by size (``shared_pool``)."""
_SEEN_PIDS: set[int] = set()
"""Every process a shared pool had, also of one stopped already (the session's last check)."""
_USERS = {2: {"module_pool", "cpu_pool", "shell", "started"}, 4: {"pool4"}}
"""The fixtures that take each shared pool (``shell``, ``started``: also their namesakes that do not)."""
_LAST_USER: dict[int, str] = {}
"""The last module of the run that takes each shared pool: its end stops the pool, so no idle ranks
hold memory while the rest of the session runs."""


def shared_pool(nproc: int, timeout: float):
    """The session's pool of ``nproc`` CPU ranks, started on first use, stopped at the session's end."""
    from mnb.controller import Pool

    pool = _SHARED.get(nproc)
    if pool is not None and pool._repair.stopped:  # a test stopped it, and a stopped pool is never relaunched
        _SEEN_PIDS.update(pool.seen_pids)
        del _SHARED[nproc]
        pool = None
    if pool is None:
        pool = Pool.start(nproc, device="cpu", timeout=timeout)
        pool.seen_pids = set(pool.pids())  # every process it had, also those a restart replaced
        _SHARED[nproc] = pool
    return pool


def for_module(size: int, request, timeout: float):
    """The shared pool of ``size`` ranks for one module (a generator for a module-scoped fixture):
    reset as it begins (also no names an earlier module defined on the ranks); as it ends, its names
    dropped (the models it made hold no memory while other modules run), or the pool stopped when
    no later module of the run takes it."""
    pool = shared_pool(size, timeout)
    reset_pool(pool, names=True)
    yield pool
    if _LAST_USER.get(size) == request.node.nodeid.split("::", 1)[0]:
        _stop_shared(size)
        return
    try:  # the shared pool now: another one when a test of the module stopped the one it began with
        _SHARED[size].run(CLEAR_NAMES + "import gc\ngc.collect()", quiet=True, timeout=300)
    except Exception:  # noqa: BLE001 - a pool the last test left broken: the next module's reset restarts it
        pass


def _stop_shared(size: int) -> None:
    pool = _SHARED.pop(size)
    _SEEN_PIDS.update(pool.seen_pids, pool.pids())
    pool.stop()


CLEAR_NAMES = (
    "from mnb.worker.sandbox import MNB_NAMES as _keep\n"
    "for _name in [n for n in globals() if n not in _keep and not n.startswith('__')]:\n"
    "    del globals()[_name]\n"
)
"""A cell that leaves the ranks' namespace as a new pool has it (mnb's names only)."""


def reset_pool(pool, *, names: bool = False):
    """Running ranks (restarted if the last test broke, interrupted or left them busy), the default layout,
    no event handlers a test added; with ``names``, none of the names cells defined.  Returns the pool to
    use: a new shared pool in place of one a test stopped (a stopped pool is never relaunched)."""
    from mnb.config import ParallelConfig

    if pool._repair.stopped:
        return shared_pool(pool.world_size, timeout=180)

    pool.event_handlers.clear()
    try:
        pool.run(CLEAR_NAMES if names else "pass", layout=ParallelConfig(), quiet=True, timeout=120)
    except Exception:  # noqa: BLE001 - whatever the last test left: start the same pool again
        pool.seen_pids |= set(pool.pids())
        pool.restart(layout=ParallelConfig())  # a restart keeps the layout: ask for the default
    pool.seen_pids |= set(pool.pids())
    return pool
