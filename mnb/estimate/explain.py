"""Where a predicted step's time goes: one table (``StepTimeEstimate.explain()``)."""

from __future__ import annotations

import html
from dataclasses import dataclass

from mnb.units import Text


@dataclass(frozen=True)
class Explanation:
    """Rows of (part, seconds) that sum to the step time, plus what overlap hid.

    Compute rows are the busiest pipeline stage's kernels over the step's
    microbatches; the bubble is that stage's wait for the others; each
    collective row is its exposed time.  Renders as text (``str``) and HTML.
    """

    rows: tuple[tuple[str, float], ...]
    hidden: tuple[tuple[str, float], ...]
    total_s: float
    mfu: float
    hfu: float
    tflops_per_gpu: float
    model: str

    def as_dict(self) -> dict[str, float]:
        """{part: seconds}, the rows as plain data."""
        return dict(self.rows)

    def table(self) -> Text:
        """The rows as aligned text (a str that shows as text as a cell's last value)."""
        width = max([len(n) for n, _ in self.rows + self.hidden] + [10])
        lines = [f"{'part':<{width}} {'s':>10} {'share':>7}"]
        for name, sec in self.rows:
            lines.append(f"{name:<{width}} {sec:10.4g} {sec / self.total_s:7.1%}")
        lines.append(f"{'step':<{width}} {self.total_s:10.4g} {1:7.1%}")
        for name, sec in self.hidden:
            lines.append(f"{'hidden: ' + name:<{width}} {sec:10.4g}   (overlapped, not in the step)")
        lines.append(f"MFU {self.mfu:.1%} (model FLOPs), HFU {self.hfu:.1%} (with recompute), "
                     f"{self.tflops_per_gpu:.1f} TFLOP/s per GPU executed; {self.model} model")
        return Text("\n".join(lines))

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><td>{html.escape(n)}</td><td>{s:.4g}</td><td>{s / self.total_s:.1%}</td></tr>"
            for n, s in self.rows
        )
        body += f"<tr><td><b>step</b></td><td><b>{self.total_s:.4g}</b></td><td>100%</td></tr>"
        body += "".join(
            f"<tr style='color:#777'><td>hidden: {html.escape(n)}</td><td>{s:.4g}</td><td>overlapped</td></tr>"
            for n, s in self.hidden
        )
        foot = (f"MFU {self.mfu:.1%} (model FLOPs), HFU {self.hfu:.1%} (with recompute), "
                f"{self.tflops_per_gpu:.1f} TFLOP/s per GPU; {html.escape(self.model)} model")
        return (f"<table class='mnb-explain'><tr><th>part</th><th>s</th><th>share</th></tr>{body}</table>"
                f"<div style='font-size:11px;color:#555'>{foot}</div>")
