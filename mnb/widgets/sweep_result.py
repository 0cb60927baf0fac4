"""The result of a layout sweep: one row per layout, a text/HTML table and a Pareto chart.

    result = mnb.sweep({"tp": [1, 2], "pp": [1, 2]}, steps=3)
    print(result.table())
    result.plot()                 # measured memory vs MFU (tokens/s on CPU), Pareto front marked
    result.best()                 # the fastest row that ran
    result.rows[0].as_dict()

In a notebook a sweep renders once: its live view ends as this result's
table and chart, and the same cell's returned value then shows nothing more
(``result`` in a later cell, or ``display(result)``, shows it again).

Pandas-free on purpose: rows are frozen-ish dataclasses; ``as_dicts()``
feeds any table library.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import asdict, dataclass, field
from typing import Any

from mnb.units import GIB, Text, format_bytes, ipython_shell

from ._render import DPI, new_figure

CHART_SIZE = (6.5, 3.6)
"""Inches of the sweep chart (live view and result)."""
CHART_SCALE = 2
"""The chart is drawn at this many pixels per display pixel, so it stays sharp on HiDPI screens."""

OK = "ok"
STATUSES = ("ok", "invalid", "oom", "error", "timeout", "died", "interrupted", "skipped")
"""Row outcomes: ran; refused before any rank ran; out of memory; rank exception; cell
timeout; a rank died (the pool is restarted); stopped by the user; not reached."""


@dataclass(kw_only=True)
class SweepRow:
    """One layout of a sweep and what happened to it."""

    index: int
    label: str
    """Layout and batch, e.g. 'tp2 pp1 dp1 mbs2'."""
    settings: dict[str, Any]
    """The grid point as given (parallel and train fields)."""
    status: str = "skipped"
    reason: str = ""
    """Why a row that did not run failed (the config's or the rank's message)."""
    peak_memory_bytes: float | None = None
    """Measured peak over the ranks (CUDA allocator, or RSS on CPU)."""
    predicted_memory_bytes: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None
    bubble: float | None = None
    """Measured bubble: the idle share of a step's pipeline span, in [0, 1] (as ``mnb.estimate.bubble``)."""
    theoretical_bubble: float | None = None
    loss: float | None = None
    wall_s: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == OK

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("metrics")
        return data


def pareto_front(rows: list[SweepRow], throughput: str) -> list[SweepRow]:
    """Rows no other row beats on both lower memory and higher ``throughput`` ('mfu' or 'tokens_per_s')."""
    pts = [r for r in rows if r.ok and r.peak_memory_bytes is not None and getattr(r, throughput) is not None]
    front = []
    for r in pts:
        dominated = any(
            o is not r and o.peak_memory_bytes <= r.peak_memory_bytes and getattr(o, throughput) >= getattr(r, throughput)
            and (o.peak_memory_bytes < r.peak_memory_bytes or getattr(o, throughput) > getattr(r, throughput))
            for o in pts
        )
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: r.peak_memory_bytes)


class SweepResult:
    """Rows of a sweep (partial when it was interrupted)."""

    def __init__(self, rows: list[SweepRow], *, model: str, steps: int, world_size: int, device: str,
                 interrupted: bool = False) -> None:
        self.rows = rows
        self.model = model
        self.steps = steps
        self.world_size = world_size
        self.device = device
        self.interrupted = interrupted
        self._live_cell: int | None = None
        """Execution count of the cell whose live view already shows this result (see :meth:`shown_live`)."""

    @property
    def throughput(self) -> str:
        """'mfu' when any row has one (GPU runs, CPU runs whose ranks measured their peak), else 'tokens_per_s'."""
        return "mfu" if any(r.mfu is not None for r in self.rows) else "tokens_per_s"

    def ok_rows(self) -> list[SweepRow]:
        return [r for r in self.rows if r.ok]

    def pareto(self) -> list[SweepRow]:
        return pareto_front(self.rows, self.throughput)

    def best(self) -> SweepRow | None:
        """The row with the highest throughput (MFU, or tokens/s on CPU)."""
        rows = [r for r in self.ok_rows() if getattr(r, self.throughput) is not None]
        return max(rows, key=lambda r: getattr(r, self.throughput)) if rows else None

    def as_dicts(self) -> list[dict[str, Any]]:
        return [r.as_dict() for r in self.rows]

    # ----- text ---------------------------------------------------------------------
    def _cells(self, r: SweepRow) -> list[str]:
        def num(v, fmt):
            return "" if v is None else format(v, fmt)

        return [
            str(r.index), r.label, r.status,
            "" if r.peak_memory_bytes is None else format_bytes(r.peak_memory_bytes),
            num(r.tokens_per_s, ",.0f"),
            "n/a" if r.ok and r.mfu is None else num(r.mfu, ".1%"),
            "" if r.step_time_s is None else f"{r.step_time_s * 1e3:.0f}",
            "" if r.bubble is None else f"{r.bubble:.0%} ({r.theoretical_bubble:.0%})",
            "*" if r in self.pareto() else "",
            r.reason,
        ]

    HEADER = ["#", "layout", "status", "peak mem", "tokens/s", "MFU", "step ms", "bubble (theory)", "pareto",
              "reason"]

    def table(self) -> Text:
        """Plain-text table, one line per layout (a str that shows as text)."""
        rows = [self.HEADER] + [self._cells(r) for r in self.rows]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.HEADER) - 1)]
        lines = []
        for row in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
        lines.append(self._footer())
        return Text("\n".join(line.rstrip() for line in lines))

    def _footer(self) -> str:
        done = sum(r.ok for r in self.rows)
        text = (f"{self.model}: {done} of {len(self.rows)} layouts ran, {self.steps} steps each, "
                f"{self.world_size} {self.device} ranks")
        return text + (" (interrupted: partial result)" if self.interrupted else "")

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<SweepResult {len(self.rows)} rows>\n{self.table()}"

    def table_html(self) -> str:
        """The table as HTML (failed rows greyed), without the chart."""
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.HEADER)
        body = []
        for r in self.rows:
            style = "" if r.ok else " style='color:#999'"
            cells = "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(r))
            body.append(f"<tr{style}>{cells}</tr>")
        return (f"<table><tr>{head}</tr>{''.join(body)}</table>"
                f"<div>{html.escape(self._footer())}</div>")

    def _repr_html_(self) -> str:
        chart = ""
        if self.ok_rows():
            png, width = self.chart_png()
            chart = f"<img width='{width}' src='data:image/png;base64,{base64.b64encode(png).decode()}'/>"
        return f"<div class='mnb-sweep'>{self.table_html()}{chart}</div>"

    def mimebundle(self) -> dict[str, str]:
        """What a notebook shows: the HTML table and chart, the text table elsewhere."""
        return {"text/plain": repr(self), "text/html": self._repr_html_()}

    def shown_live(self) -> None:
        """The live view of this cell now shows the result: its returned value adds nothing."""
        self._live_cell = _execution_count()

    def _ipython_display_(self) -> None:
        """IPython's display hook and ``display()``: once per cell with a live view, always otherwise."""
        from IPython.display import display

        if self._live_cell is not None and self._live_cell == _execution_count():
            self._live_cell = None  # the live view is this cell's one rendering
            return
        display(self.mimebundle(), raw=True)

    def chart_png(self) -> tuple[bytes, int]:
        """(PNG of :meth:`plot` at CHART_SCALE x resolution, its display width in pixels)."""
        fig, ax = new_figure(CHART_SIZE)
        self.plot(ax=ax)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=DPI * CHART_SCALE)
        return buffer.getvalue(), int(CHART_SIZE[0] * DPI)

    # ----- chart --------------------------------------------------------------------
    def plot(self, ax=None):
        """Measured peak memory per rank (x) vs MFU or tokens/s (y); the Pareto front joined and starred."""
        if ax is None:
            from mnb.plot._figure import new_axes

            _, ax = new_axes(figsize=(7.0, 4.0))
        metric = self.throughput
        scale = 100.0 if metric == "mfu" else 1.0
        ylabel = "MFU (%)" if metric == "mfu" else "tokens/s (MFU n/a: no peak)"
        pts = [r for r in self.ok_rows() if r.peak_memory_bytes is not None and getattr(r, metric) is not None]
        if not pts:
            ax.text(0.5, 0.5, "no layout ran", ha="center", va="center", transform=ax.transAxes)
            return ax
        front = self.pareto()
        others = [r for r in pts if r not in front]
        if others:
            ax.scatter([r.peak_memory_bytes / GIB for r in others], [getattr(r, metric) * scale for r in others],
                       color="#4C72B0", s=30, label="layout", zorder=3)
        ax.plot([r.peak_memory_bytes / GIB for r in front], [getattr(r, metric) * scale for r in front],
                color="#C44E52", linestyle="--", linewidth=1, zorder=2)
        ax.scatter([r.peak_memory_bytes / GIB for r in front], [getattr(r, metric) * scale for r in front],
                   marker="*", s=160, color="#F0B400", edgecolor="black", label="Pareto front", zorder=4)
        for r in pts:
            ax.annotate(r.label, (r.peak_memory_bytes / GIB, getattr(r, metric) * scale), fontsize=7,
                        xytext=(5, 4), textcoords="offset points")
        source = next((r.metrics.get("memory_source") for r in pts if r.metrics.get("memory_source")), "")
        ax.set_xlabel(f"measured peak memory per rank (GiB{', ' + source if source else ''})")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{self.model}: {len(pts)} layouts on {self.world_size} {self.device} ranks; each point one "
                     "layout's run, mean of its steps after the first", fontsize=10)
        ax.legend(fontsize=7, loc="best")
        return ax


def _execution_count() -> int | None:
    """The running cell's number in an IPython shell (constant while the cell runs), else None."""
    shell = ipython_shell()
    return getattr(shell, "execution_count", None) if shell is not None else None
