"""Shared fixtures: real pools of CPU ranks (no mocks), cleaned up after use.

One 2-rank pool (here) and one 4-rank pool (tests/megatron/conftest.py) serve the whole
session: a pool's start is most of what a test module costs.  ``reset_pool`` gives each
module and each test a pool as fresh as it needs (running ranks, the default layout, no
event handlers; each module also no names from earlier modules).  Every module ends by
checking that it left no new process behind; the session ends by stopping the shared
pools and checking every process they ever had is gone.
"""

from __future__ import annotations

import time

import psutil
import pytest

from tests import session_report
from tests.shared_pools import _LAST_USER, _SEEN_PIDS, _SHARED, _USERS, _stop_shared, for_module, reset_pool

__all__ = ["alive_pids", "assert_no_orphans", "reset_pool"]

_FILE_TIMES = session_report.FileTimes()


# ------------------------------------------------------------ the session's report
def pytest_sessionstart(session):
    session_report.install()


def pytest_runtest_logreport(report):
    _FILE_TIMES.add(report)


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    for line in _FILE_TIMES.lines():
        write(line)
    write(session_report.launches_line())


# ------------------------------------------------------------ the shared pools
@pytest.hookimpl(trylast=True)  # after -k, -m and --deselect took their items out
def pytest_collection_modifyitems(session, config, items):
    for item in items:
        for size, names in _USERS.items():
            if names & set(getattr(item, "fixturenames", ())):
                _LAST_USER[size] = item.nodeid.split("::", 1)[0]


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_pools():
    yield
    for size in list(_SHARED):
        _stop_shared(size)
    assert_no_orphans(sorted(_SEEN_PIDS))


@pytest.fixture(scope="module")
def module_pool(request):
    """The session's 2-rank CPU pool, reset for this module; tests take :func:`cpu_pool`, which resets it."""
    yield from for_module(2, request, timeout=180)


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
    return reset_pool(module_pool)  # the module's pool, or the shared pool that replaced it after a test stopped it


# ------------------------------------------------------------ processes left behind
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


def _descendants() -> dict[int, psutil.Process]:
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc
        except psutil.NoSuchProcess:
            continue
    return found


def _kept_pids() -> set[int]:
    """Processes that outlive a module on purpose: the shared pools' and a standby ``%mnb stop`` parked."""
    from mnb.controller import standby

    kept = {pid for pool in _SHARED.values() for pid in pool.descendants()}
    parked = standby._parked
    if parked is not None and parked.launcher is not None:
        kept |= {proc.pid for proc in parked.launcher.descendants()}
    return kept


LEFTOVER_WAIT_S = 30.0
"""How long a module's processes get to exit after its last fixture's teardown (a loaded machine)."""
RESTART_WAIT_S = 300.0
"""How long a shared pool's automatic restart may still run at a module's end (its new ranks are not
the pool's until they said hello)."""


@pytest.fixture(scope="module", autouse=True)
def fresh_notebook_state():
    """Each module starts as a new notebook does: no last run and no remembered settings (a shared
    pool's earlier module trained, and %mnb export would otherwise carry that run's settings)."""
    from mnb.controller import registry

    registry._LAST_RUN.clear()
    registry._SETTINGS.clear()
    yield


@pytest.fixture(scope="module", autouse=True)
def no_new_descendants():
    """Each module ends with no process it started still running (the shared pools aside)."""
    before = set(_descendants())
    yield
    restarts_end = time.monotonic() + RESTART_WAIT_S  # a shared pool's automatic restart: its new ranks are kept
    while any(pool.restarting for pool in _SHARED.values()) and time.monotonic() < restarts_end:
        time.sleep(0.2)
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while True:
        kept = _kept_pids()
        new = {pid: proc for pid, proc in _descendants().items() if pid not in before and pid not in kept}
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    described = []
    for pid, proc in new.items():
        try:
            described.append(f"{pid}: {' '.join(proc.cmdline())[:200]}")
        except psutil.Error:
            continue
    assert not described, "processes this module started are still running:\n" + "\n".join(described)
