"""Run several layouts on the live pool in turn and compare what was measured.

    result = mnb.sweep({"tp": [1, 2], "pp": [1, 2], "micro_batch_size": [1, 2]},
                       steps=3, model="tiny", global_batch_size=8)
    result = mnb.sweep([ParallelConfig(tp=2), {"pp": 2, "vpp": 2}], steps=3)

A grid is a dict of lists over :class:`mnb.config.ParallelConfig` fields
(tp, pp, vpp, cp, ep, sequence_parallel, fsdp) and the per-run
:class:`mnb.config.TrainConfig` fields (micro_batch_size, global_batch_size,
recompute, use_distributed_optimizer, bf16); its points run in
``itertools.product`` order.  Each layout is checked against the config
rules first (an invalid one is a row with the reason, no rank touched), then
trained for ``steps`` steps on the same rank processes, re-laid-out in place.
A rank exception, an out-of-memory error, a timeout or a dead rank becomes a
row with its reason (a dead pool is restarted and the sweep goes on); Kernel
-> Interrupt (KeyboardInterrupt) stops the sweep and returns the rows so far.

Progress shows as a widget in a notebook (bar, table so far, chart) and as
one printed line per layout elsewhere.  In a notebook the sweep renders once:
when it ends, the live widget is replaced in place by the result's table and
chart, and the returned value of the same cell shows nothing more.  The sweep
runs in the foreground (the cell is busy until it ends, which is what makes it
interruptible); the explorer's "Run on pool" is the background variant.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import fields
from typing import Any, Iterable

import ipywidgets as widgets

from mnb.config import ParallelConfig, TrainConfig, model_config
from mnb.errors import RankDiedError
from mnb.progress import Progress
from mnb.units import format_bytes, in_kernel

from .choices import check_layout
from .measure import TRAIN_KEYS, failure, measure, run_metrics
from .sweep_result import SweepResult, SweepRow

PARALLEL_KEYS = tuple(f.name for f in fields(ParallelConfig) if f.name != "dp")
GRID_KEYS = PARALLEL_KEYS + TRAIN_KEYS


def expand(layouts: dict[str, Iterable[Any]] | Iterable[ParallelConfig | dict[str, Any]]) -> list[dict[str, Any]]:
    """Grid points (or the given layouts) as dicts of parallel and train fields."""
    if isinstance(layouts, dict):
        keys = list(layouts)
        values = []
        for key in keys:
            options = layouts[key]
            if isinstance(options, (str, bytes)) or not isinstance(options, Iterable):
                raise ValueError(f"grid values must be lists, got {key}={options!r}; write {key}=[{options!r}]")
            values.append(list(options))
        points = [dict(zip(keys, combo)) for combo in itertools.product(*values)]
    elif isinstance(layouts, ParallelConfig):
        points = [_layout_dict(layouts)]
    else:
        points = []
        for item in layouts:
            if isinstance(item, ParallelConfig):
                points.append(_layout_dict(item))
            elif isinstance(item, dict):
                points.append(dict(item))
            else:
                raise TypeError(f"a layout is a ParallelConfig or a dict, got {type(item).__name__}")
    for point in points:
        unknown = sorted(set(point) - set(GRID_KEYS))
        if unknown:
            raise ValueError(f"unknown sweep field(s) {unknown}; choose from {', '.join(GRID_KEYS)}")
    if not points:
        raise ValueError("the sweep has no layouts")
    return points


def _layout_dict(parallel: ParallelConfig) -> dict[str, Any]:
    default = ParallelConfig()
    return {k: getattr(parallel, k) for k in PARALLEL_KEYS if getattr(parallel, k) != getattr(default, k)}


def _label(parallel: ParallelConfig, train: dict[str, Any], world: int) -> str:
    try:
        text = parallel.resolve(world).describe()
    except ValueError:
        text = parallel.describe()
    short = {"micro_batch_size": "mbs", "global_batch_size": "gbs"}
    for key, value in train.items():
        if key in short:
            text += f" {short[key]}{value}"
        elif key == "recompute" and value != "none":
            text += f" rc-{value}"
        elif key == "use_distributed_optimizer" and value:
            text += " dist-opt"
        elif key == "bf16" and value:
            text += " bf16"
        elif key == "fp8" and value:
            text += " fp8"
    return text


def sweep(
    layouts: dict[str, Iterable[Any]] | Iterable[ParallelConfig | dict[str, Any]],
    *,
    steps: int = 3,
    model: str = "tiny",
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
    recompute: str | None = None,
    use_distributed_optimizer: bool | None = None,
    bf16: bool | None = None,
    data: str | None = None,
    lr: float | None = None,
    model_overrides: dict[str, Any] | None = None,
    pool: Any = None,
    timeout: float | None = 600.0,
    gpu: str | None = None,
    show: bool = True,
) -> SweepResult:
    """Train each layout for ``steps`` steps on the pool; return a :class:`SweepResult`.

    Train settings given here apply to every point unless the grid sets them.
    ``timeout`` bounds each layout (seconds).  ``gpu`` names the hardware
    entry for MFU on CUDA pools (default: from the device name).  ``show``
    displays progress (a widget in a notebook, printed lines elsewhere).
    """
    from mnb.controller import current_pool

    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    points = expand(layouts)
    pool = pool if pool is not None else current_pool(required=True)
    base_train = {k: v for k, v in dict(
        micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, recompute=recompute,
        use_distributed_optimizer=use_distributed_optimizer, bf16=bf16, data=data, lr=lr,
    ).items() if v is not None}
    base_model = model_config(model, **(model_overrides or {}))
    world = pool.world_size
    rows: list[SweepRow] = []
    for i, point in enumerate(points):
        parallel_fields = {k: v for k, v in point.items() if k in PARALLEL_KEYS}
        train = {**base_train, **{k: v for k, v in point.items() if k in TRAIN_KEYS}}
        row = SweepRow(index=i, label="", settings=dict(point))
        try:
            parallel = ParallelConfig(**parallel_fields)
            row.label = _label(parallel, {k: v for k, v in point.items() if k in TRAIN_KEYS}, world)
            check_layout(base_model, parallel, world, TrainConfig(**train))
        except (ValueError, TypeError) as err:
            row.label = row.label or ", ".join(f"{k}={v}" for k, v in point.items())
            row.status, row.reason = "invalid", str(err)
        rows.append(row)
    result = SweepResult(rows, model=model, steps=steps, world_size=world, device=str(pool.spec.device))
    progress = _Progress(result, show)
    try:
        _run_rows(result, points, pool, progress, base_train=base_train, model=model,
                  model_overrides=model_overrides or {}, timeout=timeout, gpu=gpu)
    finally:
        progress.close()
    return result


def _run_rows(result: SweepResult, points: list[dict[str, Any]], pool: Any, progress: "_Progress", *,
              base_train: dict[str, Any], model: str, model_overrides: dict[str, Any],
              timeout: float | None, gpu: str | None) -> None:
    for row, point in zip(result.rows, points):
        if row.status == "invalid":
            progress.row_done(row)
            continue
        if not pool.running:
            row.status, row.reason = "skipped", "the pool is not running"
            progress.row_done(row)
            continue
        parallel = ParallelConfig(**{k: v for k, v in point.items() if k in PARALLEL_KEYS})
        train = {**base_train, **{k: v for k, v in point.items() if k in TRAIN_KEYS}}
        progress.row_started(row)
        t0 = time.perf_counter()
        try:
            run = measure(pool, model, parallel, train, steps=result.steps, model_overrides=model_overrides,
                          timeout=timeout, on_event=progress.on_event, gpu=gpu)
        except KeyboardInterrupt as err:
            row.status, row.reason = "interrupted", f"stopped by the user ({str(err).splitlines()[0] if str(err) else 'KeyboardInterrupt'})"
            row.wall_s = time.perf_counter() - t0
            result.interrupted = True
            progress.row_done(row)
            for later in result.rows[row.index + 1:]:
                later.reason = later.reason or "not run: the sweep was interrupted"
            return
        except Exception as err:  # every failure (PoolError, rank errors, OOM) is a row; the sweep goes on
            row.status, row.reason = failure(err)
            row.wall_s = time.perf_counter() - t0
            if isinstance(err, RankDiedError):
                row.reason += "; the pool restarted its ranks for the next layouts"
            progress.row_done(row)
            continue
        row.wall_s = time.perf_counter() - t0
        metrics = run_metrics(run)
        row.status = "ok"
        row.metrics = metrics
        for key in ("peak_memory_bytes", "predicted_memory_bytes", "tokens_per_s", "mfu", "step_time_s",
                    "bubble", "theoretical_bubble", "loss"):
            setattr(row, key, metrics.get(key))
        progress.row_done(row)


class _Progress:
    """Sweep progress: a widget in a notebook, printed lines elsewhere, nothing with show=False."""

    def __init__(self, result: SweepResult, show: bool) -> None:
        self.result = result
        self.show = show
        self.widget = None
        self._current = ""
        if show and in_kernel():
            from IPython.display import display

            self.bar = widgets.IntProgress(value=0, min=0, max=len(result.rows), description="layouts",
                                           bar_style="info")
            self.label = widgets.HTML()
            self.table = widgets.HTML()
            self.chart = widgets.Image(format="png")
            self.widget = widgets.VBox([widgets.HBox([self.bar, self.label]), self.table, self.chart])
            self.widget.add_class("mnb-sweep-progress")
            self.handle = display(self._bundle(f"sweep of {len(result.rows)} layouts: running"), raw=True,
                                  display_id=True)

    def _bundle(self, text: str) -> dict[str, Any]:
        """The widget, with a text line for front-ends that cannot render widgets."""
        bundle = self.widget._repr_mimebundle_() or {}
        bundle["text/plain"] = text
        return bundle

    def row_started(self, row: SweepRow) -> None:
        self._current = f"[{row.index + 1}/{len(self.result.rows)}] {row.label}"
        if self.widget is not None:
            self.label.value = f"<code>{self._current}: starting</code>"

    def on_event(self, rank: int, kind: str, payload: dict[str, Any]) -> None:
        if kind == "progress" and self.widget is not None:
            self.label.value = f"<code>{self._current}: {Progress.from_payload(payload).short()}</code>"

    def row_done(self, row: SweepRow) -> None:
        if not self.show:
            return
        done = row.index + 1
        if self.widget is None:
            what = (f"{row.tokens_per_s:,.0f} tokens/s, peak {format_bytes(row.peak_memory_bytes)}"
                    if row.ok and row.tokens_per_s and row.peak_memory_bytes else row.reason)
            print(f"[{done}/{len(self.result.rows)}] {row.label}: {row.status} {what}", flush=True)
            return
        self.bar.value = done
        self.table.value = self.result.table_html()
        if row.ok:
            png, width = self.result.chart_png()
            self.chart.value, self.chart.width = png, str(width)

    def close(self) -> None:
        """The live view becomes the result (rendered once, sharp), and the widgets are closed."""
        if self.widget is not None:
            self.handle.update(self.result.mimebundle(), raw=True)
            for widget in (self.widget, self.bar, self.label, self.table, self.chart):
                widget.close()
            self.widget = None
            self.result.shown_live()
