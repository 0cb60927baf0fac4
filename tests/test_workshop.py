"""The workshop's exercise checks (mnb.workshop) on any wrong answer: a clear "not right", never a crash in the
check, never the measured value; run through a real IPython shell as a check cell runs in a notebook.

The notebooks' own check cells run with 0, None and a string in tests/notebook_runner.py (tests/test_notebooks.py).
"""

from __future__ import annotations

import pytest
from IPython.core.interactiveshell import InteractiveShell

from mnb.notebook.workshop import NotRight, check_equal, check_number

MEASURED = 125_216  # e.g. notebook 07's optimizer bytes per rank
WRONG = [0, None, "a string", ..., True, float("nan"), 2 * MEASURED, [MEASURED]]


@pytest.fixture
def ip():
    shell = InteractiveShell.instance()
    shell.push({"check_number": check_number, "check_equal": check_equal, "MEASURED": MEASURED})
    return shell


def _run_check(ip, capsys, cell: str, answer):
    ip.push({"answer": answer})
    result = ip.run_cell(cell)
    return result.error_in_exec, capsys.readouterr()


@pytest.mark.parametrize("answer", WRONG, ids=repr)
def test_a_number_check_says_not_right_and_keeps_the_answer(ip, capsys, answer):
    error, shown = _run_check(ip, capsys, "check_number(answer, MEASURED, within=0.01, what='a number of bytes', "
                                          "hint='Adam keeps two moments.')", answer)
    assert isinstance(error, NotRight), error  # not ZeroDivisionError, TypeError, ...
    text = shown.out + shown.err
    assert "not right" in text or "not answered yet" in text, text
    assert "Traceback" not in text and "check_number" not in text, text  # the message alone
    if answer != [MEASURED]:  # (that answer's own repr holds it)
        assert "125216" not in text and "125,216" not in text, text  # never the measured value
    assert "times" not in text and "0.5" not in text and "2.00" not in text, text  # nor a ratio to it
    if answer is not ...:
        assert "Adam keeps two moments." in text


def test_a_number_check_passes_within_its_tolerance_and_says_which_side(ip, capsys):
    check_number(MEASURED * 1.005, MEASURED, within=0.01, hint="h")
    check_number(0.26, 0.25, abs_tol=0.02, hint="h")
    with pytest.raises(NotRight, match=r"not right: 0 is too low \(more than 1% off\)\. h"):
        check_number(0, MEASURED, within=0.01, hint="h")
    with pytest.raises(NotRight, match="too high"):
        check_number(5, 4, hint="h")
    with pytest.raises(NotRight, match="not right: True is not a whole number"):
        check_number(True, 1, what="a whole number", hint="h")


@pytest.mark.parametrize("answer", [0, None, "a string", ..., {0: ..., 1: 3}, {0: 2}, (256, 511)], ids=repr)
def test_a_structured_check_says_not_right_for_any_form(ip, capsys, answer):
    error, shown = _run_check(ip, capsys, "check_equal(answer, {0: 5077, 1: 3011}, what='a dict {stage: forwards}', "
                                          "hint='count the warm-up.')", answer)
    assert isinstance(error, NotRight), error
    text = shown.out + shown.err
    assert ("not right" in text or "not answered yet" in text) and "Traceback" not in text, text
    assert "5077" not in text and "3011" not in text, text


def test_a_structured_check_compares_plain_values():
    check_equal([(256, 511), (512, 767)], [(256, 511), (512, 767)], what="pairs", hint="h")
    check_equal((64, 88), [64, 88], what="a pair", hint="h")  # a tuple and the list that travelled
    check_equal(["b", "a"], {"a", "b"}, what="a set of names", hint="h")
    check_equal(True, True, what="True or False", hint="h")
    for wrong in (1, "True", None, 0):
        with pytest.raises(NotRight, match="is not True or False"):
            check_equal(wrong, True, what="True or False", hint="h")
    with pytest.raises(NotRight, match="is not a set of names"):
        check_equal([["a"]], {"a"}, what="a set of names", hint="h")
    with pytest.raises(NotRight, match="is not what was measured"):
        check_equal({"a"}, {"a", "b"}, what="a set of names", hint="h")
