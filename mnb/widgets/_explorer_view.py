"""The explorer's controls, output widgets and figures (the traits live in layout_explorer.py, the rules
in choices.py).

:class:`ExplorerView` owns the controls and knows nothing of the explorer: it shows a
:class:`~mnb.widgets.choices.Derived` (the settings as derived, the values each axis offers and
why not the others, the predictions) with what surrounds it (:class:`Shown`), and hands each
control's change to a callback.  The functions below turn predictions and measurements into
text, HTML and PNG figures.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Callable

import ipywidgets as widgets

from mnb.config import ParallelConfig
from mnb.presets import preset_names
from mnb.estimate import DEVICES
from mnb.plot import plot_memory, plot_schedule, plot_timeline
from mnb.units import format_bytes

from ._render import message_png, new_figure, png_bytes
from .choices import AXES, Derived

SCHEMATIC_MAX_MICROBATCHES = 24
"""The schematic timeline draws at most this many microbatches (the numbers use all of them)."""

_LABELS = {
    "num_layers": "layers", "hidden_size": "hidden", "num_attention_heads": "heads",
    "num_query_groups": "query groups", "ffn_hidden_size": "ffn hidden", "seq_length": "seq length",
    "gpu": "GPU", "gpus": "GPUs", "micro_batch_size": "micro batch", "global_batch_size": "global batch",
    "recompute": "recompute", "sequence_parallel": "sequence parallel", "fsdp": "fsdp",
    "use_distributed_optimizer": "distributed optimizer", "bf16": "bf16", "run_steps": "steps",
    "model": "model",
}
_STYLE = {"description_width": "110px"}
_WIDE = widgets.Layout(width="330px")


@dataclass(frozen=True)
class Shown:
    """What the view shows: derive()'s answer and what surrounds it."""

    derived: Derived
    run_steps: int
    measured: dict[str, Any] = field(default_factory=dict)
    """The last measured run's numbers (empty until one ran)."""
    memory_png: bytes = b""
    timeline_png: bytes = b""

    def value(self, name: str) -> Any:
        return self.run_steps if name == "run_steps" else getattr(self.derived.settings, name)

    def offered(self, axis: str) -> list[int]:
        value = self.value(axis)
        options = self.derived.options.get(axis)
        return sorted(set(options.valid if options is not None else []) | {value})

    def refused(self, axis: str) -> dict[str, str]:
        options = self.derived.options.get(axis)
        return {str(k): v for k, v in options.unavailable.items()} if options is not None else {}


class ExplorerView:
    """The controls of one explorer and the boxes they sit in.

    A control's change goes to ``on_change(name, value)`` (which may refuse it and call
    :meth:`sync` to put the shown value back); the button calls ``on_run()``.  :meth:`sync`
    pushes a :class:`Shown` into the controls, with the writers of the layout sliders off
    while their options are replaced (a new options list moves a slider to its first value,
    which is not a choice the user made).
    """

    def __init__(self, shown: Shown, *, on_change: Callable[[str, Any], None], on_run: Callable[[], None]) -> None:
        self._shown = shown
        self._on_change = on_change
        self.controls: dict[str, widgets.Widget] = {}
        self._writers: dict[str, Any] = {}
        c = self.controls
        models = preset_names()  # and the checkpoint folder the explorer was opened on
        model = shown.value("model")
        c["model"] = widgets.Dropdown(options=models + ([model] if model not in models else []), value=model)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "seq_length", "gpus", "micro_batch_size", "global_batch_size", "run_steps"):
            c[name] = widgets.IntText(value=shown.value(name))
        c["gpu"] = widgets.Dropdown(options=list(DEVICES), value=shown.value("gpu"))
        for axis in AXES:
            c[axis] = widgets.SelectionSlider(options=[shown.value(axis)], value=shown.value(axis),
                                              description=axis, continuous_update=False, style=_STYLE,
                                              layout=_WIDE)
            c[axis].add_class(f"mnb-{axis}")
            c[f"{axis}_why"] = widgets.HTML()
        c["recompute"] = widgets.Dropdown(options=["none", "selective", "full"], value=shown.value("recompute"))
        c["fsdp"] = widgets.Dropdown(options=[("none (DDP)", None), ("optim (ZeRO-1)", "optim"),
                                              ("optim_grads (ZeRO-2)", "optim_grads"),
                                              ("optim_grads_params (ZeRO-3)", "optim_grads_params")],
                                     value=shown.value("fsdp"))
        for name in ("sequence_parallel", "use_distributed_optimizer", "bf16"):
            c[name] = widgets.Checkbox(value=shown.value(name), indent=False)
        for name, control in list(c.items()):
            if name in _LABELS:
                control.description = _LABELS[name]
                control.style = _STYLE
                control.layout = _WIDE
            if not name.endswith("_why"):
                self._writers[name] = self._writer(name)
                control.observe(self._writers[name], names="value")
        c["run"] = widgets.Button(description="Run on pool", icon="play",
                                  tooltip="train a few steps of this layout on the running pool")
        c["run"].add_class("mnb-run")
        c["run"].on_click(lambda _: on_run())
        c["summary"] = widgets.HTML()
        c["summary"].add_class("mnb-summary")
        c["status"] = widgets.HTML()
        c["status"].add_class("mnb-status")
        c["memory"] = widgets.Image(format="png")
        c["memory"].add_class("mnb-memory-plot")
        c["timeline"] = widgets.Image(format="png")
        c["timeline"].add_class("mnb-timeline-plot")

    def _writer(self, name: str):
        def write(change: dict[str, Any]) -> None:
            if change["new"] != self._shown.value(name):
                self._on_change(name, change["new"])
        return write

    def children(self) -> list[widgets.Widget]:
        c = self.controls

        def box(title: str, names: list[str]) -> widgets.VBox:
            return widgets.VBox([widgets.HTML(f"<b>{title}</b>"), *[c[n] for n in names]])

        layout_rows = []
        for axis in AXES:
            layout_rows += [c[axis], c[f"{axis}_why"]]
        left = widgets.VBox([
            box("Model", ["model", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                          "ffn_hidden_size", "seq_length"]),
            box("Hardware", ["gpu", "gpus"]),
            widgets.VBox([widgets.HTML("<b>Layout</b>"), *layout_rows, c["sequence_parallel"], c["fsdp"]]),
            box("Batch and memory", ["micro_batch_size", "global_batch_size", "recompute",
                                     "use_distributed_optimizer", "bf16"]),
            widgets.VBox([widgets.HTML("<b>Measure</b>"), c["run_steps"], c["run"]]),
        ], layout=widgets.Layout(width="350px", flex="0 0 auto"))
        right = widgets.VBox([c["summary"], c["memory"], c["timeline"]],
                             layout=widgets.Layout(flex="1 1 auto", min_width="420px"))
        return [widgets.HTML("<h3 style='margin:4px 0'>mnb parallelism explorer</h3>"),
                widgets.HBox([left, right]), c["status"]]

    def sync(self, shown: Shown) -> None:
        """Push ``shown`` (settings, offered options, outputs) into the controls."""
        self._shown, c = shown, self.controls
        for name, control in c.items():
            if name in AXES:
                value, offered = shown.value(name), shown.offered(name)
                if list(control.options) != offered or control.value != value:
                    control.unobserve(self._writers[name], names="value")
                    try:
                        control.options = offered
                        control.value = value
                    finally:
                        control.observe(self._writers[name], names="value")
                _set(c[f"{name}_why"], "value", _why(name, shown.refused(name)))
            elif name in _LABELS and isinstance(control, (widgets.IntText, widgets.Dropdown, widgets.Checkbox)):
                _set(control, "value", shown.value(name))
        c["sequence_parallel"].disabled = shown.value("tp") == 1
        predicted = shown.derived.predictions.as_dict() if shown.derived.predictions is not None else {}
        _set(c["summary"], "value", summary_html(predicted, shown.measured, shown.derived.error))
        _set(c["memory"], "value", shown.memory_png)
        _set(c["timeline"], "value", shown.timeline_png)

    def sync_status(self, status: str, running: bool) -> None:
        """The status line and the run button (also called from the background run)."""
        c = self.controls
        _set(c["run"], "disabled", running)
        _set(c["run"], "description", "Running..." if running else "Run on pool")
        _set(c["status"], "value", f"<span style='color:#555'>{html.escape(status)}</span>" if status else "")


def _set(widget: widgets.Widget, name: str, value: Any) -> None:
    if getattr(widget, name) != value:
        setattr(widget, name, value)


def _why(axis: str, refused: dict[str, str]) -> str:
    if not refused:
        return ""
    items = "".join(
        f"<li><b>{axis}={html.escape(k)}</b>: {html.escape(v)}</li>"
        for k, v in sorted(refused.items(), key=lambda kv: int(kv[0]))
    )
    values = ", ".join(sorted(refused, key=int))
    return (f"<details style='font-size:11px;margin-left:8px'><summary>why not {axis} = {values}?</summary>"
            f"<ul style='margin:0;padding-left:16px'>{items}</ul></details>")


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "n/a"
    if kind == "bytes":
        return format_bytes(value)
    if kind == "pct":
        return f"{value:.1%}"
    if kind == "s":
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
    if kind == "rate":
        return f"{value:,.0f}"
    return str(value)


def summary_html(p: dict[str, Any], m: dict[str, Any], error: str = "") -> str:
    """Predicted ``p`` (and measured ``m``) peak memory, bubble, step time, tokens/s and MFU as a small table."""
    if not p:
        return f"<div class='mnb-error' style='color:#b00'>cannot estimate: {html.escape(error)}</div>"
    cap = p.get("capacity_bytes")
    fits = "" if cap is None else (" - fits" if p.get("fits") else " - <b style='color:#b00'>does not fit</b>")
    head = (f"<div class='mnb-memory-label'><b>{html.escape(p['layout'])}</b>, m={p['num_microbatches']}, "
            f"global batch {p['global_batch_size']}: peak {_fmt(p['peak_bytes'], 'bytes')} per rank "
            f"(stage {p['peak_stage']})" + (f" of {_fmt(cap, 'bytes')}" if cap else "") + fits + "</div>")
    rows = [
        ("peak memory / rank", p["peak_bytes"], m.get("peak_memory_bytes"), "bytes"),
        ("pipeline bubble", p["bubble"], m.get("bubble"), "pct"),
        ("step time", p["step_time_s"], m.get("step_time_s"), "s"),
        ("tokens/s", p["tokens_per_s"], m.get("tokens_per_s"), "rate"),
        ("MFU", p["mfu"], m.get("mfu"), "pct"),
    ]
    cells = "".join(
        f"<tr><td>{name}</td><td>{_fmt(pred, kind)}</td>"
        + (f"<td>{_fmt(meas, kind)}</td>" if m else "") + "</tr>"
        for name, pred, meas, kind in rows
    )
    header = "<tr><th></th><th>predicted</th>" + ("<th>measured</th>" if m else "") + "</tr>"
    note = ""
    if m:
        note = (f"<div style='font-size:11px;color:#555'>measured: {m['steps']} steps of {html.escape(m['layout'])}"
                f" on the pool; memory from {html.escape(str(m.get('memory_source')))}"
                + ("; MFU n/a (no peak)" if m.get("mfu") is None else "") + "</div>")
    peak = f"<div style='font-size:11px;color:#555'>MFU vs {html.escape(p.get('peak_source', ''))}</div>"
    if p.get("dp_collectives_bytes"):
        peak += f"<div class='mnb-dp-comm' style='font-size:11px;color:#555'>{html.escape(_dp_line(p))}</div>"
    if p.get("rough"):
        peak += f"<div class='mnb-rough' style='font-size:11px;color:#a60'>{html.escape(p['rough'])}</div>"
    return f"{head}<table style='font-size:12px'>{header}{cells}</table>{note}{peak}{_explain_html(p)}"


def _dp_line(p: dict) -> str:
    """The sharding level and its data-parallel collectives per step (full buffer sizes)."""
    parts = ", ".join(f"{kind.replace('_', '-')} {format_bytes(n)}" for kind, n in p["dp_collectives_bytes"].items())
    return f"data parallel ({p['sharding']}) per step: {parts}"


def _explain_html(p: dict) -> str:
    """Where the predicted step goes (``mnb.estimate.step_time(...).explain()``), one row per part."""
    rows = p.get("explain") or []
    total = p["step_time_s"]
    body = "".join(f"<tr><td>{html.escape(name)}</td><td>{_fmt(sec, 's')}</td><td>{sec / total:.1%}</td></tr>"
                   for name, sec in rows)
    return ("<details class='mnb-explain'><summary style='font-size:11px'>where the predicted step goes</summary>"
            f"<table style='font-size:11px'>{body}</table></details>") if rows else ""


def summary_text(model: str, gpus: int, gpu: str, p: dict[str, Any], m: dict[str, Any], error: str = "") -> str:
    """The predictions ``p`` (and measurements ``m``) as plain text."""
    if not p:
        return f"mnb explorer: {model} on {gpus} x {gpu}: cannot estimate: {error}"
    lines = [f"mnb explorer: {model} on {gpus} x {gpu} | {p['layout']} | "
             f"m={p['num_microbatches']} global batch {p['global_batch_size']}"]
    cap = p.get("capacity_bytes")
    lines.append(f"  predicted: peak {format_bytes(p['peak_bytes'])}/rank"
                 + (f" of {format_bytes(cap)} ({'fits' if p['fits'] else 'does not fit'})" if cap else "")
                 + f", bubble {p['bubble']:.1%}, step {p['step_time_s']:.3g} s, "
                 f"{p['tokens_per_s']:,.0f} tokens/s, MFU {p['mfu']:.1%} (vs {p.get('peak_source', '?')})")
    if p.get("rough"):
        lines.append(f"  {p['rough']}")
    if p.get("dp_collectives_bytes"):
        lines.append(f"  {_dp_line(p)}")
    if p.get("explain"):
        lines.append("  where the predicted step goes: " + ", ".join(
            f"{name} {_fmt(sec, 's')} ({sec / p['step_time_s']:.0%})" for name, sec in p["explain"]))
    if m:
        mfu = "n/a (no peak)" if m.get("mfu") is None else f"{m['mfu']:.1%}"
        lines.append(f"  measured ({m['steps']} steps on the pool): peak "
                     f"{_fmt(m.get('peak_memory_bytes'), 'bytes')}/rank ({m.get('memory_source')}), "
                     f"bubble {_fmt(m.get('bubble'), 'pct')}, "
                     f"step {m['step_time_s']:.3g} s, {m['tokens_per_s']:,.0f} tokens/s, MFU {mfu}")
    return "\n".join(lines)


def message(text: str) -> bytes:
    return message_png(text)


def memory_png(estimate: Any, run: Any = None) -> bytes:
    """Predicted components per stage (with the measured peak per rank after a run)."""
    fig, ax = new_figure((7.6, 3.4))
    plot_memory(run if run is not None else estimate, ax=ax)
    return png_bytes(fig)


def timeline_png(parallel: ParallelConfig, num_microbatches: int, run: Any = None) -> bytes:
    """Schematic 1F1B / interleaved schedule (and the measured timeline after a run)."""
    shown = min(num_microbatches, SCHEMATIC_MAX_MICROBATCHES)
    if parallel.vpp > 1 and shown < parallel.pp:
        shown = num_microbatches
    height = 0.9 + 0.45 * parallel.pp
    fig, axes = new_figure((7.6, height * (2 if run is not None else 1)), 2 if run is not None else 1, 1)
    top = axes[0] if run is not None else axes
    plot_schedule(parallel, shown, ax=top)
    if shown < num_microbatches:
        top.set_title(top.get_title() + f"\n(schematic of {shown} of {num_microbatches} microbatches)", fontsize=9)
    if run is not None:
        plot_timeline(run, ax=axes[1])
    return png_bytes(fig)
