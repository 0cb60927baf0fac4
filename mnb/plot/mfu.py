"""plot_mfu: MFU, tokens/s and loss per step (the run's step numbers, from 1, as its summary names them)."""

from __future__ import annotations

from typing import Any

from ._coerce import as_run, step_span
from ._figure import new_axes


def plot_mfu(run: Any, ax=None):
    """Three panels sharing the step axis (MFU, tokens/s, loss) when ``ax`` is None;
    with an ``ax``: MFU (or tokens/s when MFU is unknown) on it, tokens/s and
    loss on twin y-axes.  Returns the top / given Axes.
    """
    from matplotlib.ticker import MaxNLocator  # matplotlib loads when a plot is drawn, not at import

    run = as_run(run, ("steps", "mfu", "tokens_per_s", "losses", "peak_source"))
    steps = run.steps  # the model's step numbers, from 1, as the summary and the repr name them
    title = (f"{run.model.name} | {run.layout.describe()}: each of {step_span(steps)}, "
             f"MFU vs {run.peak_source}")
    mfu = run.mfu
    tps = run.tokens_per_s
    losses = run.losses
    have_mfu = any(m is not None for m in mfu)

    def pts(values):
        pairs = [(s, v) for s, v in zip(steps, values) if v is not None]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    if ax is None:
        _, axes = new_axes(3, 1, figsize=(7.0, 6.0), sharex=True)
        a_mfu, a_tps, a_loss = axes
        if have_mfu:
            x, y = pts([None if m is None else m * 100 for m in mfu])
            a_mfu.plot(x, y, marker="o", color="#4C72B0")
            a_mfu.set_ylabel("MFU (%)")
        else:
            a_mfu.text(0.5, 0.5, "MFU n/a (no peak for this device; pass peak_flops=)",
                       ha="center", va="center", transform=a_mfu.transAxes, fontsize=9)
        x, y = pts(tps)
        a_tps.plot(x, y, marker="o", color="#55A868")
        a_tps.set_ylabel("tokens/s")
        x, y = pts(losses)
        a_loss.plot(x, y, marker="o", color="#C44E52")
        a_loss.set_ylabel("loss")
        a_loss.set_xlabel("step of this run")
        a_loss.xaxis.set_major_locator(MaxNLocator(integer=True))
        a_mfu.set_title(title, fontsize=10)
        return a_mfu

    main_label = "MFU (%)" if have_mfu else "tokens/s"
    x, y = pts([None if m is None else m * 100 for m in mfu] if have_mfu else tps)
    ax.plot(x, y, marker="o", color="#4C72B0", label=main_label)
    ax.set_ylabel(main_label)
    ax.set_xlabel("step of this run")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    twins = []
    if have_mfu:
        t1 = ax.twinx()
        x, y = pts(tps)
        t1.plot(x, y, marker=".", color="#55A868", label="tokens/s")
        t1.set_ylabel("tokens/s")
        twins.append(t1)
    t2 = ax.twinx()
    if twins:
        t2.spines["right"].set_position(("axes", 1.15))
    x, y = pts(losses)
    t2.plot(x, y, marker=".", color="#C44E52", label="loss")
    t2.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    return ax
