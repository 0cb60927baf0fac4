"""The explorer's controls, output widgets and figures (the traits live in layout_explorer.py, the rules
in choices.py).

:class:`ExplorerView` owns the controls; the functions below turn the
explorer's public traits into text, HTML and PNG figures.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
from traitlets import TraitError

from mnb.config import ParallelConfig, preset_names
from mnb.estimate import DEVICES
from mnb.plot import plot_memory, plot_schedule, plot_timeline
from mnb.units import format_bytes

from ._render import message_png, new_figure, png_bytes
from .choices import AXES

if TYPE_CHECKING:
    from .layout_explorer import Explorer

SCHEMATIC_MAX_MICROBATCHES = 24
"""The schematic timeline draws at most this many microbatches (the numbers use all of them)."""

_LABELS = {
    "num_layers": "layers", "hidden_size": "hidden", "num_attention_heads": "heads",
    "num_query_groups": "query groups", "ffn_hidden_size": "ffn hidden", "seq_length": "seq length",
    "gpu": "GPU", "gpus": "GPUs", "micro_batch_size": "micro batch", "global_batch_size": "global batch",
    "recompute": "recompute", "sequence_parallel": "sequence parallel",
    "use_distributed_optimizer": "distributed optimizer", "bf16": "bf16", "run_steps": "steps",
    "model": "model",
}
_STYLE = {"description_width": "110px"}
_WIDE = widgets.Layout(width="330px")


class ExplorerView:
    """The controls of one explorer, wired to its public traits, and the boxes they sit in.

    A control's change writes the explorer's trait; a refused value (``TraitError``)
    is put back and its reason shown in the status line.  :meth:`sync` pushes the
    traits, offered options and outputs back into the controls, with the writers
    of the layout sliders off while their options are replaced (a new options list
    moves a slider to its first value, which is not a choice the user made).
    """

    def __init__(self, ex: "Explorer") -> None:
        self.ex = ex
        self.controls: dict[str, widgets.Widget] = {}
        self._writers: dict[str, Any] = {}
        c = self.controls
        models = preset_names()  # and the checkpoint folder the explorer was opened on
        c["model"] = widgets.Dropdown(options=models + ([ex.model] if ex.model not in models else []), value=ex.model)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "seq_length", "gpus", "micro_batch_size", "global_batch_size", "run_steps"):
            c[name] = widgets.IntText(value=getattr(ex, name))
        c["gpu"] = widgets.Dropdown(options=list(DEVICES), value=ex.gpu)
        for axis in AXES:
            c[axis] = widgets.SelectionSlider(options=[getattr(ex, axis)], value=getattr(ex, axis),
                                              description=axis, continuous_update=False, style=_STYLE,
                                              layout=_WIDE)
            c[axis].add_class(f"mnb-{axis}")
            c[f"{axis}_why"] = widgets.HTML()
        c["recompute"] = widgets.Dropdown(options=["none", "selective", "full"], value=ex.recompute)
        for name in ("sequence_parallel", "use_distributed_optimizer", "bf16"):
            c[name] = widgets.Checkbox(value=getattr(ex, name), indent=False)
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
        c["run"].on_click(lambda _: ex.run_on_pool())
        c["summary"] = widgets.HTML()
        c["summary"].add_class("mnb-summary")
        c["status"] = widgets.HTML()
        c["status"].add_class("mnb-status")
        c["memory"] = widgets.Image(format="png")
        c["memory"].add_class("mnb-memory-plot")
        c["timeline"] = widgets.Image(format="png")
        c["timeline"].add_class("mnb-timeline-plot")

    def _writer(self, name: str):
        ex = self.ex

        def write(change: dict[str, Any]) -> None:
            if change["new"] == getattr(ex, name):
                return
            try:
                setattr(ex, name, change["new"])
            except TraitError as err:
                ex.status = f"refused {name}={change['new']!r}: {err}"
                self.sync()
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
            widgets.VBox([widgets.HTML("<b>Layout</b>"), *layout_rows, c["sequence_parallel"]]),
            box("Batch and memory", ["micro_batch_size", "global_batch_size", "recompute",
                                     "use_distributed_optimizer", "bf16"]),
            widgets.VBox([widgets.HTML("<b>Measure</b>"), c["run_steps"], c["run"]]),
        ], layout=widgets.Layout(width="350px", flex="0 0 auto"))
        right = widgets.VBox([c["summary"], c["memory"], c["timeline"]],
                             layout=widgets.Layout(flex="1 1 auto", min_width="420px"))
        return [widgets.HTML("<h3 style='margin:4px 0'>mnb parallelism explorer</h3>"),
                widgets.HBox([left, right]), c["status"]]

    def sync(self) -> None:
        """Push the explorer's traits, options and outputs into the controls."""
        ex, c = self.ex, self.controls
        for name, control in c.items():
            if name in AXES:
                value = getattr(ex, name)
                offered = sorted(set(ex.options.get(name) or []) | {value})
                if list(control.options) != offered or control.value != value:
                    control.unobserve(self._writers[name], names="value")
                    try:
                        control.options = offered
                        control.value = value
                    finally:
                        control.observe(self._writers[name], names="value")
                _set(c[f"{name}_why"], "value", _why(name, ex.unavailable.get(name) or {}))
            elif hasattr(ex, name) and isinstance(control, (widgets.IntText, widgets.Dropdown, widgets.Checkbox)):
                _set(control, "value", getattr(ex, name))
        c["sequence_parallel"].disabled = ex.tp == 1
        _set(c["summary"], "value", summary_html(ex))
        _set(c["memory"], "value", ex.memory_png)
        _set(c["timeline"], "value", ex.timeline_png)
        self.sync_status()

    def sync_status(self) -> None:
        """The status line and the run button (also called from the background run)."""
        ex, c = self.ex, self.controls
        _set(c["run"], "disabled", ex.running)
        _set(c["run"], "description", "Running..." if ex.running else "Run on pool")
        _set(c["status"], "value", f"<span style='color:#555'>{html.escape(ex.status)}</span>" if ex.status else "")


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


def summary_html(ex: "Explorer") -> str:
    """Predicted (and measured) peak memory, bubble, step time, tokens/s and MFU as a small table."""
    p, m = ex.predicted, ex.measured
    if not p:
        return f"<div class='mnb-error' style='color:#b00'>cannot estimate: {html.escape(ex.error)}</div>"
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
    return f"{head}<table style='font-size:12px'>{header}{cells}</table>{note}{peak}"


def summary_text(ex: "Explorer") -> str:
    """The predictions (and measurements) as plain text."""
    p, m = ex.predicted, ex.measured
    if not p:
        return f"mnb explorer: {ex.model} on {ex.gpus} x {ex.gpu}: cannot estimate: {ex.error}"
    lines = [f"mnb explorer: {ex.model} on {ex.gpus} x {ex.gpu} | {p['layout']} | "
             f"m={p['num_microbatches']} global batch {p['global_batch_size']}"]
    cap = p.get("capacity_bytes")
    lines.append(f"  predicted: peak {format_bytes(p['peak_bytes'])}/rank"
                 + (f" of {format_bytes(cap)} ({'fits' if p['fits'] else 'does not fit'})" if cap else "")
                 + f", bubble {p['bubble']:.1%}, step {p['step_time_s']:.3g} s, "
                 f"{p['tokens_per_s']:,.0f} tokens/s, MFU {p['mfu']:.1%} (vs {p.get('peak_source', '?')})")
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
