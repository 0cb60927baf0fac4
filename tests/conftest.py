"""Shared fixtures: real pools of CPU ranks (no mocks), cleaned up after use."""

from __future__ import annotations

import psutil
import pytest


@pytest.fixture(scope="module")
def cpu_pool():
    """A 2-rank CPU pool shared by the tests of one module."""
    from mnb.controller import Pool

    pool = Pool.start(2, device="cpu", timeout=180)
    yield pool
    pids = pool.pids()
    pool.stop()
    assert_no_orphans(pids)


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
