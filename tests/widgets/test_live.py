"""Live training progress: the widget, its run boundaries, and its plain-text fallback."""

from __future__ import annotations

import types

import nbformat
import pytest
from nbclient import NotebookClient

from mnb.progress import Progress
from mnb.widgets.live import LiveHandler, LiveProgress, attach, detach

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _event(step, steps, loss=5.0):
    """What mnb.train sends: ``step`` counts from 1 within the call."""
    return Progress(step=step, steps=steps, global_step=step, loss=loss, tokens_per_s=999.0 + step,
                    step_time_s=0.05).as_payload()


def test_attach_is_a_no_op_outside_a_kernel():
    pool = types.SimpleNamespace(event_handlers=[])
    assert attach(pool) is None
    assert pool.event_handlers == []  # the controller keeps its text progress line
    pool.event_handlers.append(LiveHandler())
    detach(pool)
    assert pool.event_handlers == []


def test_progress_widget_updates_one_figure_in_place():
    live = LiveProgress(steps=3)
    live.update(_event(1, 3, 5.5))
    fig, first_png = live._fig, bytes(live._image.value)
    assert first_png.startswith(b"\x89PNG") and live.done == 1
    assert live.text.startswith("step 1/3 [")  # counted once: not "step 2/3"
    live.update(_event(2, 3, 5.2))
    live.update(_event(3, 3, 5.0))
    assert live._fig is fig  # the same figure, redrawn
    assert live.finished and live._bar.value == 3 and live._bar.bar_style == "success"
    assert live.losses == [5.5, 5.2, 5.0] and live.step_numbers == [1, 2, 3]
    assert bytes(live._image.value) != first_png
    assert live.text.startswith("step 3/3 [") and "loss 5.0000" in live.text
    bundle = live._repr_mimebundle_()
    assert WIDGET_MIME in bundle and bundle["text/plain"] == live.text
    assert live.get_state()["losses"] == [5.5, 5.2, 5.0]


def test_evaluation_loss_is_drawn_and_stays_in_the_line_between_evaluations():
    live = LiveProgress(steps=3)
    live.update(_event(1, 3, 5.5))
    evaluated = Progress(step=2, steps=3, loss=5.2, eval_loss=6.25, tokens_per_s=1000.0).as_payload()
    live.update(evaluated)
    assert "eval loss 6.2500" in live.text
    live.update(_event(3, 3, 5.0))
    assert live.eval_losses == [None, 6.25, None] and live.get_state()["eval_losses"] == [None, 6.25, None]
    assert "(last eval loss 6.2500)" in live.text
    assert list(live._eval_line.get_xdata()) == [2] and list(live._eval_line.get_ydata()) == [6.25]


def test_handler_starts_one_widget_per_training_run():
    handler = LiveHandler()
    handler(1, "progress", _event(1, 2))
    first = handler.current
    handler(1, "progress", _event(2, 2))
    assert handler.current is first and first.finished
    handler(1, "other", {})
    handler(1, "progress", _event(1, 2))  # a second mnb.train call: its steps count from 1 again
    assert handler.current is not first and handler.current.done == 1
    second = handler.current
    handler(1, "progress", _event(1, 2))  # a new call before this one finished (it was interrupted)
    assert handler.current is not second


def test_progress_line_is_the_controllers_line():
    assert Progress.from_payload(_event(1, 2)).line() == (
        "step 1/2 [###############...............]  loss 5.0000  1,000 tok/s (this step)  50 ms/step")


@pytest.mark.slow
def test_headless_notebook_keeps_a_text_line(tmp_path):
    """nbclient cannot render widgets: the stored output still reads as the progress line; a quiet
    ``pool.run`` shows no widget at all."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext mnb\n%mnb start -n 2 --device cpu"),
        nbformat.v4.new_code_cell("%%megatron --pp 2\nm = mnb.gpt('tiny')\n"
                                  "_ = mnb.train(m, steps=3, micro_batch_size=2, global_batch_size=8)"),
        nbformat.v4.new_code_cell(  # quiet: no widget, no progress line, no rank output
            "_ = mnb.pool().run(\"print('hidden'); q = mnb.gpt('tiny'); "
            "mnb.train(q, steps=2, micro_batch_size=2, global_batch_size=8)\", quiet=True)\n"
            "print('quiet run done', mnb.last_run.steps)"),
        nbformat.v4.new_code_cell("%mnb stop"),
    ]
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[1].outputs
    assert not [o for o in outputs if o.output_type == "error"]
    widgets = [o for o in outputs if WIDGET_MIME in o.get("data", {})]
    assert len(widgets) == 1, outputs
    assert widgets[0]["data"]["text/plain"].startswith("step 3/3 [######")
    streams = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "step 1/3" not in streams  # no duplicate text line beside the widget
    quiet = nb.cells[2].outputs
    assert not [o for o in quiet if o.output_type == "error"], quiet
    assert not [o for o in quiet if WIDGET_MIME in o.get("data", {})], quiet
    assert [o.get("text") for o in quiet] == ["quiet run done [1, 2]\n"], quiet
