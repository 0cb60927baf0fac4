"""The workshop notebooks' exercise checks (notebooks 05-12): a learner's prediction against the measurement.

Every check cell of a workshop notebook goes through these two functions::

    from mnb.workshop import check_number, check_equal
    check_number(predicted_optimizer_bytes, measured, within=0.01, what="a number of bytes",
                 hint="the distributed optimizer keeps Adam's state only for this rank's shard")
    check_equal(predicted_fc1, measured_fc1, what="a tuple (out_features, in_features)", hint="...")

A prediction that does not match raises :class:`NotRight`, whatever it is (``...``, ``0``, ``None``, a
string, a number of the wrong size): one line, "not right: <why>. <hint>", shown without a traceback.
The message never holds the measured value (nor a ratio to it): the cell after a passing check prints it.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

from mnb.errors import NotRight

__all__ = ["NotRight", "check_equal", "check_number"]


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(float(value))


def _unanswered(answer: Any, what: str) -> None:
    if _holds_ellipsis(answer):
        raise NotRight(f"not answered yet: replace each ... in the exercise cell with {what}")


def _holds_ellipsis(value: Any) -> bool:
    if value is Ellipsis:
        return True
    if isinstance(value, dict):
        return any(_holds_ellipsis(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_ellipsis(v) for v in value)
    return False


def _shown(answer: Any) -> str:
    text = repr(answer)
    return text if len(text) <= 80 else text[:77] + "..."


def check_number(answer: Any, measured: float, *, hint: str, within: float = 0.0, abs_tol: float = 0.0,
                 what: str = "a number") -> None:
    """Raise :class:`NotRight` unless ``answer`` is a number within ``within`` (a fraction of ``measured``:
    0.01 is 1 %) or ``abs_tol`` of ``measured``; neither asks for the exact value.  The message says too high
    or too low, and ``hint``."""
    _unanswered(answer, what)
    if not _is_number(answer):
        raise NotRight(f"not right: {_shown(answer)} is not {what}. {hint}")
    if abs(answer - measured) <= max(abs(measured) * within, abs_tol):
        return
    side = "too high" if answer > measured else "too low"
    off = f" (more than {within:.0%} off)" if within else ""
    raise NotRight(f"not right: {answer:,} is {side}{off}. {hint}")


def check_equal(answer: Any, measured: Any, *, hint: str, what: str) -> None:
    """Raise :class:`NotRight` unless ``answer`` equals ``measured``, compared as plain values: a tuple equals
    the list of the same items, ``2`` equals ``2.0``, a bool only a bool.  ``what`` names the expected form."""
    _unanswered(answer, what)
    if not _same_form(answer, measured):
        raise NotRight(f"not right: {_shown(answer)} is not {what}. {hint}")
    if isinstance(measured, (set, frozenset)):  # a set asked for: a list or tuple of its items will do
        answer = set(answer)
    if _plain(answer) != _plain(measured):
        raise NotRight(f"not right: {_shown(answer)} is not what was measured. {hint}")


def _same_form(answer: Any, measured: Any) -> bool:
    """Whether ``answer`` has the form of ``measured`` (numbers for numbers, pairs for pairs, same keys' kinds)."""
    if isinstance(measured, bool):
        return isinstance(answer, bool)
    if _is_number(measured):
        return _is_number(answer)
    if isinstance(measured, str):
        return isinstance(answer, str)
    if isinstance(measured, dict):
        return isinstance(answer, dict)
    if isinstance(measured, (set, frozenset)):  # items of the measured items' kind (hashable, then)
        kinds = {type(m) for m in measured} or {str, int, float, tuple}
        return isinstance(answer, (set, frozenset, list, tuple)) and all(type(a) in kinds for a in answer)
    if isinstance(measured, (list, tuple)):
        return (isinstance(answer, (list, tuple)) and len(answer) == len(measured)
                and all(_same_form(a, m) for a, m in zip(answer, measured)))
    return True


def _plain(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if _is_number(value):
        return float(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return frozenset(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value
