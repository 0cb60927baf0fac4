"""One training step's progress event: what a rank sends, and the one way it reads.

The rank that holds the loss emits one ``"progress"`` event per finished step
(``mnb.train``, and a user's own schedule loop through ``mnb.record``); the
controller's text line, the live widget, the explorer and the sweep all read
it through :class:`Progress`::

    >>> p = Progress(step=3, steps=10, loss=5.1234, tokens_per_s=8035.0, step_time_s=0.064)
    >>> p.line()
    'step 3/10 [#########.....................]  loss 5.1234  8,035 tok/s (this step)  64 ms/step'
    >>> p.short()
    'step 3/10'
    >>> Progress.from_payload(p.as_payload()) == p
    True

``step`` counts from 1: the steps finished in this ``mnb.train`` call, so the
last event of a call has ``step == steps``.  The model's own step number (from 1,
going on across calls: a second call of 3 steps after 3 is 4-6; the record's, the
repr's and the summary's number) is ``global_step``.  Stdlib only: both sides import it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

BAR_WIDTH = 30


@dataclass(frozen=True)
class Progress:
    """One finished training step, as the ranks report it."""

    step: int
    """Steps finished in this training call, counted from 1 (the last event has ``step == steps``)."""
    steps: int
    """Steps this training call takes (0 when unknown)."""
    global_step: int | None = None
    """The model's number of the step just finished (from 1, continues across calls; the record's ``step``)."""
    loss: float | None = None
    tokens_per_s: float | None = None
    """This step's rate (a run's summary gives the mean of steps 2-N: the first includes warm-up)."""
    step_time_s: float | None = None
    eval_loss: float | None = None
    """The evaluation loss (``mnb.train(eval_data=..., eval_every=K)``) when this step ended with one."""

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> "Progress":
        """From an event's payload (unknown keys ignored, missing ones default)."""
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in payload.items() if k in known}
        data["step"] = int(data.get("step") or 0)
        data["steps"] = int(data.get("steps") or 0)
        return cls(**data)

    def as_payload(self) -> dict[str, Any]:
        """The event's payload (JSON-able)."""
        return asdict(self)

    @property
    def finished(self) -> bool:
        """The last step of its training call."""
        return bool(self.steps) and self.step >= self.steps

    def short(self) -> str:
        """'step 3/10' ('step 3' when the number of steps is unknown)."""
        return f"step {self.step}/{self.steps}" if self.steps else f"step {self.step}"

    def line(self) -> str:
        """'step 3/10 [#########....]  loss 5.1234  8,035 tok/s (this step)  64 ms/step'."""
        filled = min(BAR_WIDTH, int(BAR_WIDTH * self.step / self.steps)) if self.steps else 0
        parts = [f"{self.short()} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}]"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.eval_loss is not None:
            parts.append(f"eval loss {self.eval_loss:.4f}")
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s (this step)")
        if self.step_time_s:
            parts.append(f"{self.step_time_s * 1000:.0f} ms/step")
        return "  ".join(parts)
