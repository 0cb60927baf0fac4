"""The explorer's "Run on pool": a short measured run of one layout, in a background thread.

A :class:`PoolRunner` knows nothing of widgets: it is given a :class:`RunRequest`,
re-lays-out the live ranks (``pool.run(code, layout=...)``), trains
``steps`` steps, and hands a :class:`RunOutcome` (the gathered
:class:`mnb.analysis.runs.Run`, or why it failed) to the callback it was made with::

    runner = PoolRunner(on_done=lambda outcome: print(outcome.metrics or outcome.failure))
    runner.start(pool, RunRequest(model="tiny", parallel=ParallelConfig(pp=2),
                                  train={"global_batch_size": 8}, steps=3))
    runner.wait()

The kernel is free meanwhile; the callbacks run in the runner's thread (the
explorer's update widget traits, which ipykernel sends from any thread).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from mnb.config import ParallelConfig
from mnb.progress import Progress

from .measure import failure, measure, run_metrics


def no_pool_problem(pool: Any) -> str:
    """Why ``pool`` cannot take a measured run ('' when it can)."""
    if pool is None or not pool.running:
        return "no pool is running: start one with %mnb start -n 2 --device cpu"
    return ""


@dataclass(frozen=True)
class RunRequest:
    """What to train: ``mnb.gpt(model, **model_overrides)`` under ``parallel``, ``steps`` steps of ``train``."""

    model: str
    parallel: ParallelConfig
    train: dict[str, Any]
    """TrainConfig fields passed to ``mnb.train``."""
    steps: int
    model_overrides: dict[str, Any] = field(default_factory=dict)
    gpu: str | None = None
    """Hardware-table entry for MFU (None: CUDA pools pick it from the device name; CPU pools have none)."""
    tag: Any = None
    """Anything the caller wants back with the outcome (the explorer: the settings it ran)."""


@dataclass(frozen=True)
class RunOutcome:
    """How a measured run ended: ``run`` and ``metrics``, or ``failure`` = (status, reason)."""

    request: RunRequest
    run: Any = None
    metrics: dict[str, Any] | None = None
    failure: tuple[str, str] | None = None


class PoolRunner:
    """One measured run at a time on the pool, in a background thread.

    ``on_done(outcome)`` is called once per run (in the run's thread, before it
    ends); ``on_progress(progress)`` with each :class:`~mnb.progress.Progress`
    the ranks report.
    """

    def __init__(self, on_done: Callable[[RunOutcome], None],
                 on_progress: Callable[[Progress], None] | None = None) -> None:
        self._on_done = on_done
        self._on_progress = on_progress
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, pool: Any, request: RunRequest, *, timeout: float | None = 600.0) -> threading.Thread:
        """Start the run; the returned thread ends after ``on_done`` returned."""
        problem = no_pool_problem(pool) or ("a measured run is already in progress" if self.running else "")
        if problem:
            raise RuntimeError(problem)
        thread = threading.Thread(target=self._main, args=(pool, request, timeout), daemon=True,
                                  name="mnb-explorer-run")
        self._thread = thread
        thread.start()
        return thread

    def wait(self, timeout: float | None = None) -> None:
        """Block until the run (if any) has finished."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _event(self, rank: int, kind: str, payload: dict) -> None:
        if kind == "progress" and self._on_progress is not None:
            self._on_progress(Progress.from_payload(payload))

    def _main(self, pool: Any, request: RunRequest, timeout: float | None) -> None:
        try:
            run = measure(pool, request.model, request.parallel, request.train, steps=request.steps,
                          model_overrides=request.model_overrides, timeout=timeout, on_event=self._event,
                          gpu=request.gpu)
        except Exception as err:  # an outcome like any other: the thread must not die silently
            outcome = RunOutcome(request, failure=failure(err))
        else:
            outcome = RunOutcome(request, run=run, metrics=run_metrics(run))
        self._on_done(outcome)
