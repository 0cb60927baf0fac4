"""One short measured training run on the live pool, and the numbers the widgets show.

Used by the explorer's "Run on pool" button and by :func:`mnb.widgets.sweep`::

    from mnb.widgets.measure import measure
    run = measure(pool, "tiny", ParallelConfig(pp=2), {"micro_batch_size": 2,
                  "global_batch_size": 8}, steps=3)
    run_metrics(run)["tokens_per_s"]

The ranks are re-laid-out in place (``pool.run(code, layout=...)``), build the
model, train, and drop the model again so the next layout starts from the
same memory.  Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from mnb.config import ParallelConfig
from mnb.errors import CellTimeoutError, CompositeRankError, RankDiedError

TRAIN_KEYS = ("micro_batch_size", "global_batch_size", "recompute", "use_distributed_optimizer", "bf16",
              "lr", "data", "seed", "fp8")
"""TrainConfig fields a sweep grid may set per point (the explorer sends its own TRAIN_TRAITS)."""


def training_code(model: str, model_overrides: dict[str, Any], train: dict[str, Any], steps: int) -> str:
    """The cell the ranks run: build the model, train ``steps`` steps, free the model.

    A Hugging Face checkpoint folder is built by ``mnb.gpt`` from its config.json's shape with
    random weights: step time and memory do not depend on the weights, and none are read.
    """
    from mnb.model_source import checkpoint_folder, resolve_model

    train_args = "".join(f", {k}={v!r}" for k, v in sorted(train.items()) if v is not None)
    source = resolve_model(model).to_dict() if checkpoint_folder(model) is not None else model
    return (
        f"_mnb_measure_model = mnb.gpt({source!r}, **{model_overrides!r})\n"
        f"mnb.train(_mnb_measure_model, steps={int(steps)}{train_args})\n"
        "del _mnb_measure_model\n"
    )


@contextlib.contextmanager
def handlers_replaced(pool: Any, handlers: list[Callable[[int, str, dict], None]]) -> Iterator[None]:
    """Route the pool's rank events to ``handlers`` only, for the duration of a run.

    Keeps the live-progress widget (and the default text line, which prints when
    there is no handler) out of a sweep's or a background run's output.
    """
    saved = list(pool.event_handlers)
    pool.event_handlers[:] = handlers
    try:
        yield
    finally:
        pool.event_handlers[:] = saved


def measure(
    pool: Any,
    model: str,
    parallel: ParallelConfig,
    train: dict[str, Any],
    *,
    steps: int,
    model_overrides: dict[str, Any] | None = None,
    timeout: float | None = None,
    on_event: Callable[[int, str, dict], None] | None = None,
    gpu: str | None = None,
):
    """Train ``steps`` steps under ``parallel`` on ``pool``; return the gathered :class:`mnb.analysis.runs.Run`.

    Rank exceptions, timeouts and deaths propagate (see :func:`failure`).
    ``gpu`` names the hardware-table entry for MFU (CUDA pools pick it from the
    device name when not given; CPU pools have no MFU).
    """
    from mnb.analysis.runs import Run

    code = training_code(model, model_overrides or {}, train, steps)
    with handlers_replaced(pool, [on_event] if on_event else [lambda *a: None]):
        pool.run(code, layout=parallel, quiet=True, timeout=timeout)
    if not pool.last_cell_records:
        raise RuntimeError("the ranks trained but sent no run record")
    cpu = str(pool.spec.device).startswith("cpu")
    return Run(pool.last_cell_records, gpu=None if cpu else gpu)


def failure(err: BaseException) -> tuple[str, str]:
    """(status, reason) of a failed run: 'oom', 'error', 'timeout' or 'died'."""
    if isinstance(err, CompositeRankError):
        oom = any("OutOfMemory" in e.ename for e in err.errors)
        seen: list[str] = []
        for members, _ in err.groups():
            first = members[0]
            ranks = ",".join(str(m.rank) for m in members)
            text = f"rank {ranks}: {first.ename}: {first.evalue.strip().splitlines()[0] if first.evalue.strip() else ''}"
            if text not in seen:
                seen.append(text)
        return ("oom" if oom else "error"), "; ".join(seen)
    if isinstance(err, CellTimeoutError):
        return "timeout", str(err).splitlines()[0]
    if isinstance(err, RankDiedError):
        return "died", str(err).splitlines()[0]
    return "error", f"{type(err).__name__}: {err}"


def _mean(values: list[float | None], skip_first: bool = True) -> float | None:
    vals = [v for v in values if v is not None]
    if skip_first and len(vals) > 1:
        vals = vals[1:]
    return sum(vals) / len(vals) if vals else None


def run_metrics(run: Any) -> dict[str, Any]:
    """Measured numbers of a Run (first step left out of the means: it includes warm-up)."""
    peaks = run.peak_memory_bytes
    try:
        predicted = run.predicted_memory.peak_bytes
    except ValueError:
        predicted = None
    losses = [x for x in run.losses if x is not None]
    return {
        "layout": run.layout.describe(),
        "steps": len(run.steps),
        "num_microbatches": run.num_microbatches,
        "peak_memory_bytes": max(peaks.values()) if peaks else None,
        "peak_memory_by_rank": {str(k): v for k, v in sorted(peaks.items())},
        "memory_source": run.memory_source,
        "predicted_memory_bytes": predicted,
        "step_time_s": _mean(run.step_times_s),
        "tokens_per_s": _mean(run.tokens_per_s),
        "mfu": _mean(run.mfu),
        "bubble": run.measured_bubble,
        "theoretical_bubble": run.theoretical_bubble,
        "loss": losses[-1] if losses else None,
    }
