"""Shared fixtures: real pools of CPU ranks (no mocks), cleaned up after use."""

from __future__ import annotations

import psutil
import pytest


@pytest.fixture(scope="module")
def module_pool():
    """A 2-rank CPU pool started once per test module; tests take :func:`cpu_pool`, which resets it."""
    from mnb.controller import Pool

    pool = Pool.start(2, device="cpu", timeout=180)
    pool.seen_pids = set(pool.pids())  # every process it had, also those an earlier restart replaced
    yield pool
    pool.seen_pids |= set(pool.pids())
    pool.stop()
    assert_no_orphans(sorted(pool.seen_pids))


@pytest.fixture(scope="module")
def shell(module_pool):
    """An IPython shell with mnb's magics loaded, driving the module's pool (``%%megatron``, ``%mnb``)."""
    from IPython.core.interactiveshell import InteractiveShell

    from mnb.controller.registry import set_current_pool

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "mnb")
    set_current_pool(module_pool)
    yield ip
    set_current_pool(None)


@pytest.fixture
def cpu_pool(module_pool):
    """The module's pool, reset before each test so one test's failure cannot cascade into the next."""
    reset_pool(module_pool)
    return module_pool


def reset_pool(pool) -> None:
    """Running ranks (restarted if the last test broke, interrupted or left them busy), the default
    layout, no event handlers a test added."""
    from mnb.config import ParallelConfig

    pool.event_handlers.clear()
    try:
        pool.run("pass", layout=ParallelConfig(), quiet=True, timeout=120)
    except Exception:  # noqa: BLE001 - whatever the last test left: start the same pool again
        pool.seen_pids |= set(pool.pids())
        pool.restart(layout=ParallelConfig())  # a restart keeps the layout: ask for the default
    pool.seen_pids |= set(pool.pids())


def alive_pids(pids: list[int]) -> list[int]:
    """The pids that still name a running (not zombie) process."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def assert_no_orphans(pids: list[int]) -> None:
    left = alive_pids(pids)
    assert not left, f"processes left behind: {left}"
