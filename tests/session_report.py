"""What a test session cost: launches of processes that import torch and Megatron-Core, and seconds per file.

CI's time goes to process starts, not to assertions, so the session ends with two reports
(``tests/conftest.py`` installs them; ``.ci/run`` shows them per leg)::

    seconds per test file (top 12 of 12; set-up = fixtures, e.g. a pool's start; all files: 1530 s):
      ...
    mnb launches: 9 (pools 2, restarts 3, rank launches 2, kernels 2)  [2 Jupyter kernel process(es) started]

What each number counts:

* pools: ``Launcher.start`` calls made inside ``Pool.start`` in this process (a torchrun tree);
* restarts: the other ``Launcher.start`` calls in this process (``Pool.restart``, automatic
  relaunches after a failure, standbys launched ahead);
* rank launches: ``tests/megatron/ranks.py``'s ``run_ranks`` (one launch of N fresh gloo ranks),
  and plain torchruns this process started (``torch.distributed.run``/``torchrun``: a script's
  reference run, another node joining a pool);
* kernels: pools and torchruns started by other processes this session started (a Jupyter
  kernel's ``%mnb start`` and its restarts, a notebook, a script run in a subprocess): each
  torchrun (a pool's agent ``mnb.worker.agent``, or ``torch.distributed.run``) seen among this
  process's descendants whose parent is not this process.  Jupyter kernels themselves import
  no torch (tests/test_no_torch.py); the count of kernel processes follows in brackets.

The total is the sum of the four.  The descendants are sampled once a second: an agent
lives for its ranks' imports (seconds), so none is missed.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, defaultdict

import psutil

COUNTS: Counter = Counter()
_local = threading.local()
_seen_agents: set[tuple[int, float]] = set()
_kernel_procs: set[tuple[int, float]] = set()
_stop = threading.Event()


def count_rank_launch() -> None:
    """Called by ``run_ranks`` once per launch of its ranks."""
    COUNTS["rank launches"] += 1


def install() -> None:
    """Count this process's launches (wrapping ``Pool.start`` and the launchers' ``start``) and
    watch the descendants for pools other processes start."""
    import importlib

    launcher, slurm = (importlib.import_module(f"mnb.controller.{name}") for name in ("launcher", "slurm"))
    from mnb.controller import Pool

    original_start = Pool.start.__func__

    def counted_pool_start(cls, *args, **kwargs):
        _local.in_pool_start = getattr(_local, "in_pool_start", 0) + 1
        try:
            return original_start(cls, *args, **kwargs)
        finally:
            _local.in_pool_start -= 1

    Pool.start = classmethod(counted_pool_start)
    for cls in (launcher.Launcher, slurm.SlurmLauncher):
        if "start" in cls.__dict__:
            _wrap_launcher(cls)
    threading.Thread(target=_watch, name="tests-launch-watch", daemon=True).start()


def _wrap_launcher(cls) -> None:
    original = cls.__dict__["start"]

    def counted_start(self, *args, **kwargs):
        COUNTS["pools" if getattr(_local, "in_pool_start", 0) else "restarts"] += 1
        return original(self, *args, **kwargs)

    cls.start = counted_start


def _watch() -> None:
    me = os.getpid()
    while not _stop.wait(1.0):
        _sample(me)


def _sample(me: int) -> None:
    try:
        children = psutil.Process(me).children(recursive=True)
    except psutil.Error:
        return
    for proc in children:
        try:
            cmdline = proc.cmdline()
            key = (proc.pid, proc.create_time())
            agent = "mnb.worker.agent" in cmdline  # a pool's torchrun
            torchrun = "torch.distributed.run" in cmdline or any(arg.endswith("/torchrun") for arg in cmdline)
            if (agent or torchrun) and key not in _seen_agents:
                _seen_agents.add(key)
                if proc.ppid() != me:
                    COUNTS["kernels"] += 1
                elif not agent:  # a plain torchrun this process started (e.g. a script's reference run)
                    COUNTS["rank launches"] += 1
            elif "ipykernel_launcher" in " ".join(cmdline) and key not in _kernel_procs:
                _kernel_procs.add(key)
        except psutil.Error:
            continue


def launches_line() -> str:
    _sample(os.getpid())
    _stop.set()
    pools, restarts, ranks, kernels = (COUNTS[k] for k in ("pools", "restarts", "rank launches", "kernels"))
    total = pools + restarts + ranks + kernels
    return (f"mnb launches: {total} (pools {pools}, restarts {restarts}, rank launches {ranks}, kernels {kernels})"
            f"  [{len(_kernel_procs)} Jupyter kernel process(es) started]")


class FileTimes:
    """Seconds per test file: set-up (fixtures), call and teardown of each of its tests."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(self, report) -> None:
        path = report.nodeid.split("::", 1)[0]
        self.seconds[path][report.when] += report.duration

    def lines(self, top: int = 15) -> list[str]:
        totals = {path: sum(parts.values()) for path, parts in self.seconds.items()}
        ranked = sorted(totals, key=totals.get, reverse=True)
        if not ranked:
            return []
        lines = [f"seconds per test file (top {min(top, len(ranked))} of {len(ranked)}; "
                 f"set-up = fixtures, e.g. a pool's start; all files: {sum(totals.values()):.0f} s):"]
        for path in ranked[:top]:
            parts = self.seconds[path]
            lines.append(f"  {totals[path]:7.1f} s  (set-up {parts['setup']:6.1f} s, teardown {parts['teardown']:5.1f} s)"
                         f"  {path}")
        return lines
