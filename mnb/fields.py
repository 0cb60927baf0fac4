"""Every field of a config dataclass checked against its annotation, where it is made.

Python does not check dataclass annotations: ``TrainConfig(recompute="ful")`` would
be stored and train without recompute, ``ParallelConfig(tp=True)`` would be a layout
of one.  :func:`check_fields` (called first in each ``__post_init__`` of
:mod:`mnb.config`) refuses, with the field's name and what it accepts:

- a ``Literal`` field's value outside its choices (the message lists them);
- a bool where an ``int`` or ``float`` is meant (``True`` is an ``int`` to Python);
- a value of another type for ``int``, ``float``, ``bool`` and ``str`` fields, each
  optionally ``| None``.

Integers of other kinds (numpy's) are stored as Python ints so records stay JSON.
Annotations it does not know (``dict[...]``, ``Any``, ...) are left alone, so fields
added later need no change here.  :func:`check_ranks` is the one check of a rank list against a
world size.  Standard library only: both sides import it.
"""

from __future__ import annotations

import numbers
import sys
import types
import typing
from dataclasses import fields
from functools import lru_cache
from typing import Any, Iterable, Literal

_NONE = type(None)


@lru_cache(maxsize=None)
def _rules(cls: type) -> tuple[tuple[str, tuple, bool], ...]:
    """(field name, accepted kinds, None allowed) for each field whose annotation is understood."""
    namespace = vars(sys.modules[cls.__module__])
    out = []
    for f in fields(cls):
        hint = f.type
        if isinstance(hint, str):
            try:
                hint = eval(hint, namespace, {"Literal": Literal})  # noqa: S307 - the module's own annotation
            except Exception:  # a name only known to type checkers: not checked
                continue
        parts = typing.get_args(hint) if _is_union(hint) else (hint,)
        optional = _NONE in parts
        kinds = tuple(p for p in parts if p is not _NONE)
        if kinds and all(_understood(k) for k in kinds):
            out.append((f.name, kinds, optional))
    return tuple(out)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) is typing.Union or isinstance(hint, types.UnionType)


def _understood(kind: Any) -> bool:
    return kind in (int, float, bool, str) or typing.get_origin(kind) is Literal


def _accepts(kind: Any, value: Any) -> tuple[bool, Any]:
    """Whether ``value`` fits ``kind``, and the value to store."""
    if typing.get_origin(kind) is Literal:
        return value in typing.get_args(kind) and not isinstance(value, bool), value
    if kind is bool:
        return isinstance(value, bool), value
    if isinstance(value, bool):
        return False, value
    if kind is int:
        return isinstance(value, numbers.Integral), int(value) if isinstance(value, numbers.Integral) else value
    if kind is float:
        return isinstance(value, numbers.Real), value
    return isinstance(value, kind), value


def _wanted(kinds: tuple, optional: bool) -> str:
    words = []
    for kind in kinds:
        if typing.get_origin(kind) is Literal:
            words.append("one of " + ", ".join(repr(c) for c in typing.get_args(kind)))
        else:
            words.append({int: "an integer (not a bool)", float: "a number (not a bool)",
                          bool: "True or False", str: "a string"}[kind])
    return " or ".join(words) + (" or None" if optional else "")


def check_fields(obj: Any) -> None:
    """Raise ValueError naming the first field of ``obj`` whose value its annotation refuses."""
    for name, kinds, optional in _rules(type(obj)):
        value = getattr(obj, name)
        if value is None and optional:
            continue
        for kind in kinds:
            ok, stored = _accepts(kind, value)
            if ok:
                if stored is not value:
                    object.__setattr__(obj, name, stored)
                break
        else:
            raise ValueError(f"{type(obj).__name__}.{name} must be {_wanted(kinds, optional)}, got {value!r}")


def choices(cls: type, name: str) -> tuple:
    """The choices of a ``Literal`` field (for flags and widgets that offer them)."""
    for field_name, kinds, _ in _rules(cls):
        if field_name == name:
            return tuple(c for k in kinds if typing.get_origin(k) is Literal for c in typing.get_args(k))
    raise KeyError(f"{cls.__name__}.{name} is not a Literal field")


def check_ranks(ranks: Iterable[int], world_size: int) -> list[int]:
    """``ranks`` sorted, or ValueError when one is not a rank of ``world_size`` (or there are none).

    The one rule, and wording, for every rank list (``--ranks``, ``--debug-ranks``, ``--profile-ranks``,
    ``%mnb run --ranks``, ``pool.run(ranks=...)``)."""
    chosen = sorted(set(ranks))
    bad = [r for r in chosen if not 0 <= r < world_size]
    if bad or not chosen:
        raise ValueError(f"rank(s) {bad or '(none)'} not in this pool of world size {world_size} "
                         f"(valid: 0-{world_size - 1})")
    return chosen


def seconds_rule(*, zero_ok: bool = False) -> str:
    """The words of :func:`check_seconds`'s rule (the magics' flags say the same)."""
    return "a number, zero or positive" if zero_ok else "a positive number"


def check_seconds(value: Any, name: str, *, zero_ok: bool = False) -> float:
    """``value`` as seconds: a positive number (``zero_ok``: zero too); TypeError (not a number) or
    ValueError (out of range, NaN) naming ``name``, the rule and the value.

    The one rule for every timeout and grace: the magics' ``--timeout``/``--cell-timeout``/``--grace``
    (``mnb.notebook.parsers``), ``pool.run``/``run_script``'s ``timeout``/``grace``, ``Pool.start``'s."""
    rule = seconds_rule(zero_ok=zero_ok)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {rule} of seconds, got {value!r} ({type(value).__name__})")
    if not (value >= 0 if zero_ok else value > 0):  # NaN fails both
        raise ValueError(f"{name} must be {rule} of seconds, got {value!r}")
    return float(value)
