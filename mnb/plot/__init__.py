"""Matplotlib figures of predicted and measured memory, pipeline timelines, MFU, loss and plans.

Every function is ``plot_x(obj, ax=None) -> Axes``: it draws into ``ax`` or,
without one, into a new figure (a pyplot figure inside a Jupyter kernel so it
displays inline, a bare ``Figure`` elsewhere: see :mod:`mnb.plot._figure`).
Nothing calls ``plt.show()`` or changes global styles::

    from mnb.plot import plot_memory, plot_timeline, plot_schedule, plot_mfu, plot_plan
    plot_memory(run)                                    # or an estimate alone
    plot_schedule(ParallelConfig(pp=4, vpp=2, dp=1), 8)
    plot_plan(mnb.estimate.plan("llama-7b", gpus=8, gbs=128))
    ax = plot_mfu(run); ax.figure.savefig("mfu.png")
    plot_loss(run)                                      # training and evaluation loss
"""

from __future__ import annotations

from .loss import plot_loss
from .memory import plot_memory
from .mfu import plot_mfu
from .plan import plot_plan
from .timeline import plot_schedule, plot_timeline

__all__ = ["plot_loss", "plot_memory", "plot_mfu", "plot_plan", "plot_schedule", "plot_timeline"]
