"""Errors that cross from ranks to the notebook.

A rank never sends exception objects (they may hold torch tensors or classes
the notebook kernel cannot import); it sends plain data: the exception's
name, its message and the formatted traceback.  The controller rebuilds them
into one :class:`CompositeRankError` per cell, so "Run All" stops at the
failing cell, and IPython renders it through ``_render_traceback_`` with one
block per distinct traceback, labelled by the ranks and parallel coordinates
that raised it (identical tracebacks are folded).

Every exception mnb raises to a user is defined here, so ``from mnb.errors import ...`` catches any of
them: the pool's own (``PoolError``, ``RankDiedError``, ``CellTimeoutError``, ``RequestRefused``), the
wire's (``ProtocolError``, ``MessageTooLarge``), values that cannot travel (``PushRefused``,
``ValueDecodeError``) and those raised inside a cell on the ranks (``NoStdinError``,
``DamagedCheckpointError``, ``CudaStreamError``, ``ScriptGroupError``); the modules that raise them
import them from here (their old import paths keep working).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Any, Iterable

from mnb.units import format_mib


def _rebuild(cls: type, values: dict[str, Any], state: dict[str, Any]) -> BaseException:
    error = cls(**values)
    error.__dict__.update(state)
    return error


class _TravellingFields:
    """Pickle and ``copy.deepcopy`` for a dataclass exception: rebuilt from its fields.

    An exception pickles as ``type(e)(*e.args)``; a dataclass exception's ``args`` are not its
    fields (``CompositeRankError``'s are its summary line), so logging handlers, process pools
    and ``copy.deepcopy`` broke on it.  Attributes set later (``add_note``'s ``__notes__``)
    travel too.
    """

    def __reduce__(self):
        names = [f.name for f in fields(self)]  # type: ignore[arg-type]
        state = {k: v for k, v in self.__dict__.items() if k not in names}
        return _rebuild, (type(self), {name: getattr(self, name) for name in names}, state)


@dataclass(eq=False)
class RankError(_TravellingFields, Exception):
    """One rank's exception, as plain data."""

    rank: int
    ename: str
    evalue: str
    traceback: str = ""
    label: str = ""
    """Rank and coordinates, e.g. 'r3 tp1 pp0 dp1'."""

    def __post_init__(self) -> None:
        super().__init__(str(self))  # args: the message, however the fields were passed

    def __str__(self) -> str:
        return f"[{self.label or f'r{self.rank}'}] {self.ename}: {self.evalue}"


def format_rank_set(ranks: Iterable[int]) -> str:
    """'r0-3', 'r0,2-3' — compact, for labels of folded output."""
    ordered = sorted(set(ranks))
    if not ordered:
        return "r-"
    parts: list[str] = []
    start = prev = ordered[0]
    for value in ordered[1:] + [None]:  # type: ignore[list-item]
        if value is not None and value == prev + 1:
            prev = value
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return "r" + ",".join(parts)


@dataclass(eq=False)
class CompositeRankError(_TravellingFields, Exception):
    """The exceptions of every failing rank of one cell, grouped by traceback.

    ``errors`` is in the order the ranks failed: the first entry is the root
    cause (the rank that failed first), the others follow.  ``waiting`` names
    the ranks that had not finished when the cell was ended and where each
    waited (``cell line 3 `dist.barrier()` -> distributed_c10d.py:4810 in barrier``);
    ``notes`` are one-line statements of what mnb did about it (e.g. which
    ranks it restarted).  ``shown_above`` is the root cause's traceback when
    mnb already printed it while other ranks still ran: rendering names it
    instead of printing the same traceback a second time.
    """

    errors: list[RankError]
    cell_ranks: list[int] = field(default_factory=list)
    headline: str = ""
    waiting: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    shown_above: str = ""

    def __post_init__(self) -> None:
        super().__init__(self._summary())

    @property
    def root_cause(self) -> RankError | None:
        return self.errors[0] if self.errors else None

    def groups(self) -> list[tuple[list[RankError], str]]:
        """Errors grouped by identical (name, message, traceback), root cause's group first."""
        grouped: dict[tuple[str, str, str], list[RankError]] = {}
        for error in self.errors:
            grouped.setdefault((error.ename, error.evalue, error.traceback), []).append(error)
        return [(sorted(members, key=lambda e: e.rank), key[2]) for key, members in grouped.items()]

    @property
    def ranks(self) -> list[int]:
        return sorted(e.rank for e in self.errors)

    def _summary(self) -> str:
        lines = [self.headline or self._default_headline()]
        for members, _ in self.groups():
            first = members[0]
            lines.append(f"  {self._label(members)} {first.ename}: {first.evalue}")
        lines.extend(self._tail())
        return "\n".join(lines)

    def _tail(self) -> list[str]:
        return [f"  {line}" for _, line in sorted(self.waiting.items())] + [f"  {n}" for n in self.notes]

    def _default_headline(self) -> str:
        failed = len(self.errors)
        total = len(self.cell_ranks) or failed
        if self.waiting and self.errors:
            first = self.errors[0]
            return (f"rank {first.rank} failed first ({first.ename}); "
                    f"{len(self.waiting)} of {total} ranks had not finished")
        return f"{failed} of {total} ranks raised an exception"

    @staticmethod
    def _label(members: list[RankError]) -> str:
        if len(members) == 1:
            return f"[{members[0].label or f'r{members[0].rank}'}]"
        return f"[{format_rank_set(m.rank for m in members)}]"

    def __str__(self) -> str:
        return self._summary()

    def _render_traceback_(self) -> list[str]:
        """IPython calls this instead of printing Python's own traceback."""
        red, bold, reset = "\x1b[31m", "\x1b[1m", "\x1b[0m"
        out = [f"{bold}{red}{self.headline or self._default_headline()}{reset}"]
        for index, (members, traceback_text) in enumerate(self.groups()):
            first = members[0]
            out.append("")
            cause = " (first failure)" if index == 0 and (self.waiting or len(self.groups()) > 1) else ""
            out.append(f"{bold}{self._label(members)}{cause}{reset}")
            if len(members) > 1:
                out.append("  " + ", ".join(m.label or f"r{m.rank}" for m in members))
            body = traceback_text.rstrip("\n")
            if body and body == self.shown_above.rstrip("\n"):
                out.append(f"(the traceback printed above; {first.ename}: {first.evalue})")
            else:
                out.extend(body.splitlines() or [f"{first.ename}: {first.evalue}"])
        tail = self._tail()
        if tail:
            out.append("")
            out.extend(tail)
        return out


class RequestRefused(ValueError):
    """A request the pool refused before sending anything (bad ranks, a layout change on some ranks).

    Its message says what to change; ``%%megatron`` shows it as a usage error.
    Other exceptions from a request are never dressed up as usage errors.
    """


class OverwriteRefusedError(FileExistsError):
    """An mnb writer refused a target that holds something not its own (a user's files, another kind of output).

    Its message lists what is there and names the flag that allows writing anyway
    (``overwrite=True``, or ``--overwrite`` for a magic); even then mnb replaces only the
    files it writes (:mod:`mnb.writes`).
    """


class PoolError(RuntimeError):
    """The pool cannot do what was asked (not started, busy, dead ranks).

    Rendered in a notebook as its message alone: what happened and the next
    step, never mnb's own traceback.
    """

    def _render_traceback_(self) -> list[str]:
        return _message_lines(type(self).__name__, str(self))


def _message_lines(name: str, text: str) -> list[str]:
    """``name: first line`` in red, then the other lines: how the pool's errors show in a notebook."""
    red, reset = "\x1b[31m", "\x1b[0m"
    lines = text.splitlines() or [name]
    return [f"{red}{name}: {lines[0]}{reset}", *lines[1:]]


class RankDiedError(PoolError):
    """One or more ranks exited while the pool was in use."""

    def __init__(self, message: str, deaths: dict[int, str] | None = None):
        super().__init__(message)
        self.deaths = deaths or {}


class LayoutRefused(PoolError):
    """New ranks of an automatic restart answered that they cannot take the pool's layout: a second
    launch would answer the same, so the restart fails at once with their errors."""


class CellTimeoutError(PoolError, TimeoutError):
    """A cell ran past its timeout; carries each stuck rank's stack (``.stacks``, and in ``str()``)."""

    def __init__(self, message: str, stacks: dict[int, str] | None = None):
        super().__init__(message)
        self.stacks = stacks or {}

    def _render_traceback_(self) -> list[str]:
        """Where each rank waited and what follows; the full stacks stay in ``.stacks`` and ``%mnb stacks``."""
        text = str(self)
        head, _, rest = text.partition("\nPython stack of")
        lines = _message_lines(type(self).__name__, head.rstrip())  # its own name: `except CellTimeoutError` is what catches it
        if rest:
            lines += [text.rstrip().splitlines()[-1], "(each rank's Python stack: error.stacks, or %mnb stacks)"]
        return lines


def interrupted(message: str) -> KeyboardInterrupt:
    """A KeyboardInterrupt that a notebook shows as one line, ``message``.

    It stays a real ``KeyboardInterrupt`` (Run All stops, ``except
    KeyboardInterrupt`` catches it); IPython renders it through
    ``_render_traceback_`` as ipyparallel's errors do, instead of a traceback
    through mnb's own waiting loop.
    """
    error = KeyboardInterrupt(message)
    # a partial of a module function, not a lambda: the error still pickles
    error._render_traceback_ = functools.partial(_one_line, message)  # type: ignore[attr-defined]
    return error


def _one_line(message: str) -> list[str]:
    return [f"KeyboardInterrupt: {message}"]


# ---------------------------------------------------------------- raised by the notebook side's parts
# (defined here so that every error a user catches imports from mnb.errors; the modules that raise
# them import them from here, and their old import paths keep working)

class ProtocolError(Exception):
    """A message that is malformed, of an unknown type, or wrongly signed."""


_TOO_LARGE_ADVICE = {
    "push": "nothing was sent and the ranks are as they were; push less at once (a slice, or a file's path "
            "for the ranks to read)",
    "execute": "nothing was sent and the ranks are as they were; the cell's code or the script's arguments are "
               "too long (read large data from a file on the ranks instead)",
    "reply": "send less at once (e.g. pull a slice or a summary of the value)",
}
"""What to do about a message over the limit, by its type (the kernel's requests; the ranks' replies)."""


class MessageTooLarge(ProtocolError):
    """A message that would exceed the protocol's limit (``mnb.protocol.MAX_MESSAGE_BYTES``); it was never sent."""

    def __init__(self, kind: str, size_bytes: int, limit_bytes: int):
        self.kind = kind
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes
        super().__init__(
            f"{'an' if kind[:1] in tuple('aeiou') else 'a'} {kind} message would be {format_mib(size_bytes)}, over "
            f"the {format_mib(limit_bytes)} "
            f"limit of one message; {_TOO_LARGE_ADVICE.get(kind, _TOO_LARGE_ADVICE['reply'])}"
        )

    def __reduce__(self):  # rebuilt from its fields, not from its message (pickle, copy.deepcopy)
        return type(self), (self.kind, self.size_bytes, self.limit_bytes), dict(self.__dict__)


class ValueDecodeError(ValueError):
    """Pulled values the notebook kernel could not rebuild.

    ``problems``: {name: why} for those; ``decoded``: {name: value} for the others.
    """

    def __init__(self, problems: dict[str, str], decoded: dict[str, Any]):
        self.problems, self.decoded = problems, decoded
        super().__init__("; ".join(f"{name}: {why}" for name, why in problems.items()))

    def __reduce__(self):  # rebuilt from its fields, not from its message (pickle, copy.deepcopy)
        return type(self), (self.problems, self.decoded), dict(self.__dict__)


class PushRefused(TypeError):
    """A push the ranks could not rebuild, refused before anything was sent; shown as its message alone."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[31mTypeError: {str(self).splitlines()[0]}\x1b[0m", *str(self).splitlines()[1:]]


# ---------------------------------------------------------------- raised on the ranks, inside a cell

class NoStdinError(RuntimeError):
    """The notebook's front-end cannot answer ``input()`` (nbclient, ``allow_stdin=False``)."""


class DamagedCheckpointError(ValueError):
    """A checkpoint folder whose ``mnb.json`` or ``metadata.json`` is missing, truncated or wrong."""


class CudaStreamError(RuntimeError):
    """A CUDA-only feature a CPU rank cannot honour."""


class ScriptGroupError(ValueError):
    """The script asked for a process group the pool cannot give it."""


# ---------------------------------------------------------------- the workshop notebooks' checks

class NotRight(AssertionError):
    """A prediction that is not the measured value; in a notebook, its message alone (no traceback)."""

    def _render_traceback_(self) -> list[str]:  # IPython's hook: what the cell's error shows
        return [f"{type(self).__name__}: {self}"]
