"""Live training progress: a progress bar and a loss / tokens-per-second plot updated in place.

``%mnb start`` calls :func:`attach` on the new pool; by hand::

    from mnb.widgets.live import attach
    attach(mnb.pool())          # then every mnb.train(...) cell shows a live widget

The pool calls its ``event_handlers`` with each rank event; the handler here
turns each ``"progress"`` event (a :class:`mnb.progress.Progress` payload; ``step``
counts from 1 within one ``mnb.train`` call) into one :class:`LiveProgress` widget
per training call.  The plot is one
figure redrawn into an ``Image`` (never a new figure per step).

Where widgets cannot render:

- terminals and plain IPython shells (no kernel): :func:`attach` installs
  nothing, so the controller keeps its default text progress line;
- headless runs (nbclient / nbconvert) keep the widget's text/plain
  representation, which is the same progress line, updated once the run ends.
"""

from __future__ import annotations

import time
from typing import Any

import ipywidgets as widgets
from traitlets import Float, Int, List, Unicode

from mnb.progress import Progress
from mnb.units import in_kernel

from ._render import new_figure, on_main_thread, png_bytes

REDRAW_S = 0.4
"""Least time between two redraws of the plot (the bar and the text update every step)."""
NEW_RUN_GAP_S = 30.0
"""Progress events further apart than this start a new widget."""


class LiveProgress(widgets.VBox):
    """One training run's progress: bar, text line and a loss / tokens/s plot."""

    done = Int(0, help="Steps finished in this run.").tag(sync=True)
    steps = Int(0, help="Steps this run will take.").tag(sync=True)
    step_numbers = List(Int(), help="This run's step number (from 1) per finished step: the plot's x axis.").tag(
        sync=True)
    losses = List(Float(allow_none=True), help="Loss per finished step.").tag(sync=True)
    tokens_per_s = List(Float(allow_none=True), help="Tokens per second per finished step.").tag(sync=True)
    eval_losses = List(Float(allow_none=True),
                       help="Evaluation loss per finished step (None where the step did not evaluate).").tag(sync=True)
    text = Unicode("", help="The progress line (also the plain-text representation).").tag(sync=True)

    def __init__(self, steps: int) -> None:
        self._bar = widgets.IntProgress(value=0, min=0, max=max(steps, 1), bar_style="info",
                                        layout=widgets.Layout(width="420px"))
        self._label = widgets.HTML()
        self._image = widgets.Image(format="png")
        super().__init__([widgets.HBox([self._bar, self._label]), self._image])
        self.add_class("mnb-live")
        self.steps = steps
        self._fig = self._axes = self._lines = None
        self._last_draw = 0.0
        self.last_event = time.monotonic()

    @property
    def finished(self) -> bool:
        return self.done >= self.steps

    def update(self, payload: dict[str, Any]) -> None:
        """Add one finished step."""
        self.last_event = time.monotonic()
        progress = Progress.from_payload(payload)
        with self.hold_sync():
            self.done = progress.step
            self.step_numbers = [*self.step_numbers, progress.step]
            self.losses = [*self.losses, progress.loss]
            self.tokens_per_s = [*self.tokens_per_s, progress.tokens_per_s]
            self.eval_losses = [*self.eval_losses, progress.eval_loss]
            self.text = progress.line()
            evaluated = [v for v in self.eval_losses if v is not None]
            if progress.eval_loss is None and evaluated:  # keep the last evaluation in view
                self.text += f"  (last eval loss {evaluated[-1]:.4f})"
            self._bar.value = min(self.done, self._bar.max)
            self._label.value = f"<code>step {self.done}/{self.steps}  {self.text.split('] ', 1)[-1]}</code>"
            if self.finished:
                self._bar.bar_style = "success"
        if self.finished or time.monotonic() - self._last_draw > REDRAW_S:
            self.redraw()

    def redraw(self) -> None:
        """Update the lines of the one figure and re-encode it."""
        if self._fig is None:
            self._fig, (a_loss, a_tps) = new_figure((6.4, 2.2), 1, 2)
            self._lines = (a_loss.plot([], [], marker=".", color="#C44E52", label="train")[0],
                           a_tps.plot([], [], marker=".", color="#55A868")[0])
            self._eval_line = a_loss.plot([], [], marker="o", color="#4C72B0", label="eval")[0]
            a_loss.set_xlabel("step")
            a_loss.set_ylabel("loss")
            a_tps.set_xlabel("step")
            a_tps.set_ylabel("tokens/s")
            self._axes = (a_loss, a_tps)
        rows = ((self._lines[0], self._axes[0], self.losses), (self._lines[1], self._axes[1], self.tokens_per_s),
                (self._eval_line, self._axes[0], self.eval_losses))
        if any(v is not None for v in self.eval_losses) and self._axes[0].get_legend() is None:
            self._axes[0].legend(fontsize=7)
        for line, ax, values in rows:
            pairs = [(s, v) for s, v in zip(self.step_numbers, values) if v is not None]
            line.set_data([p[0] for p in pairs], [p[1] for p in pairs])
            ax.relim()
            ax.autoscale_view()
        self._image.value = png_bytes(self._fig)
        self._last_draw = time.monotonic()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/plain"] = self.text or f"step 0/{self.steps}"
        return bundle


class LiveHandler:
    """A pool event handler that shows one :class:`LiveProgress` per training run."""

    shows_output = True
    """It draws into the cell's output: a quiet request (``pool.run(..., quiet=True)``) skips it."""

    def __init__(self) -> None:
        self.current: LiveProgress | None = None
        self._handle = None

    def __call__(self, rank: int, kind: str, payload: dict[str, Any]) -> None:
        if kind != "progress" or not on_main_thread():
            return  # background runs (the explorer's) report in their own widget
        progress = Progress.from_payload(payload)
        steps = progress.steps
        cur = self.current
        if (cur is None or cur.finished or cur.steps != steps
                or (cur.step_numbers and progress.step <= cur.step_numbers[-1])  # a new mnb.train call
                or time.monotonic() - cur.last_event > NEW_RUN_GAP_S):
            self._start(steps)
        self.current.update(payload)
        if self.current.finished and self._handle is not None:
            self._handle.update(self.current)  # headless front-ends keep the final text line

    def _start(self, steps: int) -> None:
        from IPython.display import display

        self.current = LiveProgress(steps)
        self._handle = display(self.current, display_id=True)


def attach(pool: Any) -> LiveHandler | None:
    """Show live training widgets for ``pool``'s runs; None (nothing installed) outside a kernel."""
    if not in_kernel():
        return None
    detach(pool)
    handler = LiveHandler()
    pool.event_handlers.append(handler)
    return handler


def detach(pool: Any) -> None:
    """Remove the live handlers from ``pool`` (the default text line comes back)."""
    pool.event_handlers[:] = [h for h in pool.event_handlers if not isinstance(h, LiveHandler)]
