"""Errors that cross from ranks to the notebook.

A rank never sends exception objects (they may hold torch tensors or classes
the notebook kernel cannot import); it sends plain data: the exception's
name, its message and the formatted traceback.  The controller rebuilds them
into one :class:`CompositeRankError` per cell, so "Run All" stops at the
failing cell, and IPython renders it through ``_render_traceback_`` with one
block per distinct traceback, labelled by the ranks and parallel coordinates
that raised it (identical tracebacks are folded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass(eq=False)
class RankError(Exception):
    """One rank's exception, as plain data."""

    rank: int
    ename: str
    evalue: str
    traceback: str = ""
    label: str = ""
    """Rank and coordinates, e.g. 'r3 tp1 pp0 dp1'."""

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
class CompositeRankError(Exception):
    """The exceptions of every failing rank of one cell, grouped by traceback."""

    errors: list[RankError]
    cell_ranks: list[int] = field(default_factory=list)
    headline: str = ""

    def __post_init__(self) -> None:
        super().__init__(self._summary())

    def groups(self) -> list[tuple[list[RankError], str]]:
        """Errors grouped by identical (name, message, traceback)."""
        grouped: dict[tuple[str, str, str], list[RankError]] = {}
        for error in sorted(self.errors, key=lambda e: e.rank):
            grouped.setdefault((error.ename, error.evalue, error.traceback), []).append(error)
        return [(members, key[2]) for key, members in grouped.items()]

    @property
    def ranks(self) -> list[int]:
        return sorted(e.rank for e in self.errors)

    def _summary(self) -> str:
        lines = [self.headline or self._default_headline()]
        for members, _ in self.groups():
            first = members[0]
            lines.append(f"  {self._label(members)} {first.ename}: {first.evalue}")
        return "\n".join(lines)

    def _default_headline(self) -> str:
        failed = len(self.errors)
        total = len(self.cell_ranks) or failed
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
        for members, traceback_text in self.groups():
            first = members[0]
            out.append("")
            out.append(f"{bold}{self._label(members)}{reset}")
            if len(members) > 1:
                out.append("  " + ", ".join(m.label or f"r{m.rank}" for m in members))
            out.extend(traceback_text.rstrip("\n").splitlines() or [f"{first.ename}: {first.evalue}"])
        return out


class PoolError(RuntimeError):
    """The pool cannot do what was asked (not started, dead ranks, stuck ranks)."""


class RankDiedError(PoolError):
    """One or more ranks exited while the pool was in use."""

    def __init__(self, message: str, deaths: dict[int, str] | None = None):
        super().__init__(message)
        self.deaths = deaths or {}


class CellTimeoutError(PoolError, TimeoutError):
    """A cell ran past its timeout; carries each stuck rank's stack."""

    def __init__(self, message: str, stacks: dict[int, str] | None = None):
        super().__init__(message)
        self.stacks = stacks or {}

    def _render_traceback_(self) -> list[str]:
        return str(self).splitlines()
