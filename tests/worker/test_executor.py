"""A failed cell's frames give back what they held, even when something keeps the exception."""

from __future__ import annotations

from mnb.worker.executor import run_cell

CELL = """
import weakref

class Activations:  # stands for a failed step's tensors
    pass

kept = []  # stands for a library that keeps the last exception (a logger, a retry helper)

def step():
    activations = Activations()
    refs.append(weakref.ref(activations))
    raise MemoryError("out of memory in the step")

refs = []
try:
    step()
except MemoryError as exc:
    kept.append(exc)
    raise
"""


def test_a_kept_exception_does_not_pin_the_failed_steps_locals():
    namespace: dict = {}
    outcome = run_cell(CELL, namespace, number=1)
    assert not outcome.ok and outcome.ename == "MemoryError"
    assert "in step" in outcome.traceback and "out of memory in the step" in outcome.traceback
    assert namespace["kept"] and namespace["kept"][0].__traceback__ is not None  # the exception is still kept
    assert namespace["refs"][0]() is None  # but the step's locals are gone


def test_a_successful_cell_keeps_its_globals():
    namespace: dict = {}
    assert run_cell("x = [1, 2]\nlen(x)", namespace, number=2).value == 2
    assert namespace["x"] == [1, 2]


def test_a_trailing_semicolon_hides_the_result_as_in_ipython_comments_included():
    for code, shown in (("1 + 1;", False), ("1 + 1;  # quiet, as IPython", False), ("1 + 1;\n\n# note\n", False),
                        ("1 + 1", True), ("1 + 1  # ';' only in a comment;", True), ("'a;'", True)):
        assert (run_cell(code, {}, number=3).value == (2 if code.startswith("1") else "a;")) is shown, code


def test_a_refusal_by_mnb_shows_the_cells_line_and_the_check_not_mnbs_frames_between():
    """An argument mnb's checks refuse (a ValueError raised in mnb): the traceback keeps the cell's line and the
    line that raised, and each run of mnb's frames between them is one line; anything else keeps every frame."""
    cell = ("from mnb.config import TrainConfig, model_config\n"
            "def build():\n"
            "    return model_config('tiny', hidden_size=-3)\n"
            "build()\n")
    outcome = run_cell(cell, {}, number=4)
    text = outcome.traceback
    assert outcome.ename == "ValueError" and "hidden_size" in outcome.evalue
    assert 'File "<cell-4>", line 4' in text and 'File "<cell-4>", line 3, in build' in text
    assert "frame(s) inside mnb ..." in text
    mnb_frames = [line for line in text.splitlines() if line.strip().startswith('File "') and "/mnb/" in line]
    assert len(mnb_frames) == 1 and text.rstrip().endswith(outcome.evalue.splitlines()[-1])
    # raised by the user's own code: untouched
    other = run_cell("def f():\n    raise ValueError('mine')\nf()\n", {}, number=5).traceback
    assert "inside mnb" not in other and 'in f' in other
