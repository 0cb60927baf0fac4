"""The explorer's "Run on pool": a short measured run of its layout, in a background thread.

A mixin of :class:`mnb.widgets.layout_explorer.Explorer` (it uses the explorer's
traits and redraws through it).  The thread re-lays-out the live ranks
(``pool.run(code, layout=...)``), trains ``run_steps`` steps, and puts the
gathered :class:`mnb.runs.Run` beside the predictions.  The kernel is free
meanwhile; widget updates from the thread are comm messages, which ipykernel
sends from any thread.
"""

from __future__ import annotations

import threading
from typing import Any

from mnb.progress import Progress

from . import _explorer_view as view
from .measure import failure, measure, run_metrics


class PoolRunMixin:
    """pool_problem / run_on_pool / wait for the explorer."""

    def pool_problem(self, pool: Any = None) -> str:
        """Why "Run on pool" cannot run now ('' when it can)."""
        from mnb.controller import current_pool

        pool = pool if pool is not None else current_pool(required=False)
        if pool is None or not pool.running:
            return "no pool is running: start one with %mnb start -n 2 --device cpu"
        if self.running:
            return "a measured run is already in progress"
        if self.gpus != pool.world_size:
            return (f"the explorer plans {self.gpus} GPUs but the pool has {pool.world_size} ranks; "
                    f"set gpus to {pool.world_size} to run this layout")
        if self.error:
            return f"this layout cannot run: {self.error}"
        return ""

    def run_on_pool(self, pool: Any = None, *, wait: bool = False, timeout: float = 600.0) -> threading.Thread | None:
        """Train ``run_steps`` steps of this layout on the pool in a background thread.

        Returns the thread (``wait=True`` joins it).  The kernel stays free; the
        measured memory, timeline and MFU/tokens/s appear when the ranks finish.
        Returns None, with the reason in ``status``, when the pool cannot run it.
        """
        from mnb.controller import current_pool

        pool = pool if pool is not None else current_pool(required=False)
        problem = self.pool_problem(pool)
        if problem:
            self.status = problem
            return None
        self.running = True
        args = dict(model=self.model, parallel=self.parallel_config(), train=self._train_args(),
                    steps=self.run_steps, model_overrides=self._model_overrides())
        self.status = f"running {self.run_steps} steps of {args['parallel'].resolve(pool.world_size).describe()} on the pool..."
        thread = threading.Thread(target=self._measure, args=(pool, args, timeout), daemon=True,
                                  name="mnb-explorer-run")
        self._thread = thread
        thread.start()
        if wait:
            thread.join()
        return thread

    def _on_progress(self, rank: int, kind: str, payload: dict) -> None:
        if kind == "progress":
            self.status = f"running on the pool: {Progress.from_payload(payload).short()}"

    def _measure(self, pool: Any, args: dict[str, Any], timeout: float) -> None:
        try:
            run = measure(pool, args["model"], args["parallel"], args["train"], steps=args["steps"],
                          model_overrides=args["model_overrides"], timeout=timeout,
                          on_event=self._on_progress, gpu=self.gpu)
        except Exception as err:  # shown to the user in the widget; the thread must not die silently
            status, reason = failure(err)
            self.status = f"run failed ({status}): {reason}"
            self.running = False
            return
        metrics = run_metrics(run)
        with self._lock:
            self._run = run
            self.measured = metrics
            self.running = False
            self._estimate()
            view.sync_controls(self)
        self.status = f"measured {metrics['steps']} steps of {metrics['layout']} on the pool"

    def wait(self, timeout: float | None = None) -> None:
        """Block until the background run (if any) has finished."""
        if self._thread is not None:
            self._thread.join(timeout)
