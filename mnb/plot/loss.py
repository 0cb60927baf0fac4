"""plot_loss: training loss per step with the evaluation loss on the same axes."""

from __future__ import annotations

from typing import Any

from ._coerce import as_run, step_span
from ._figure import new_axes


def plot_loss(run: Any, ax=None):
    """Training loss per step (line) and evaluation loss where it was measured (markers).

    The evaluation loss comes from ``mnb.train(..., eval_data=..., eval_every=K)``
    (``run.eval_losses``: None at steps without an evaluation).  Returns the Axes.
    """
    run = as_run(run, ("steps", "losses", "eval_losses"))
    if ax is None:
        _, ax = new_axes(figsize=(7.0, 3.6))
    # the run's step numbers (from 1, going on across mnb.train calls), as the summary and the repr name them
    numbers = run.steps
    train = [(i, v) for i, v in zip(numbers, run.losses) if v is not None]
    evals = [(i, v) for i, v in zip(numbers, run.eval_losses) if v is not None]
    ax.plot([s for s, _ in train], [v for _, v in train], marker=".", color="#C44E52", label="training loss")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], marker="o", color="#4C72B0",
                label="evaluation loss")
    from matplotlib.ticker import MaxNLocator  # matplotlib loads when a plot is drawn, not at import

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: a 3-step run had ticks at 1.25, 1.5
    ax.set_ylabel("loss (per token)")
    ax.legend(fontsize=8)
    ax.set_title(f"{run.model.name} | {run.layout.describe()}: loss at each of {step_span(numbers)}"
                 + (f", {len(evals)} evaluations" if evals else ""), fontsize=10)
    return ax
