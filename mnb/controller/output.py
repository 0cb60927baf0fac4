"""Showing what ranks print and display, labelled and folded.

Each complete line is labelled by its rank and parallel coordinates,
``[r3 tp1 pp0 dp1] loss 2.31``.  Lines that every rank of the cell prints
alike are shown once, labelled by the rank set: ``[r0-3] built model``.  To
fold while still streaming live, a line waits at most ``fold_window_s`` for
the same line from the other ranks.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Any, Callable

from mnb.errors import format_rank_set
from mnb.progress import Progress
from mnb.units import in_kernel, ipython_shell

Write = Callable[[str, str], None]  # (stream name, text)


def write_to_sys(name: str, text: str) -> None:
    stream = sys.stderr if name == "stderr" else sys.stdout
    stream.write(text)
    stream.flush()


def coords_label(rank: int, coords: dict[str, int] | None, layout: dict[str, Any] | None = None) -> str:
    """'r3 tp1 pp0 dp1' (cp/ep only when the layout uses them)."""
    parts = [f"r{rank}"]
    coords = coords or {}
    layout = layout or {}
    for name in ("tp", "pp", "dp", "cp", "ep"):
        if name not in coords:
            continue
        if name in ("cp", "ep") and (layout.get(name) or 1) <= 1:
            continue
        parts.append(f"{name}{coords[name]}")
    return " ".join(parts)


class LineFolder:
    """Assembles per-rank text into lines and writes them labelled, folding repeats."""

    def __init__(self, ranks: list[int], labels: dict[int, str], write: Write = write_to_sys,
                 fold_window_s: float = 0.3):
        self.ranks = sorted(ranks)
        self.labels = labels
        self.write = write
        self.fold_window_s = fold_window_s
        self._partial: dict[tuple[str, int], str] = {}
        self._pending: dict[str, dict[int, deque[tuple[float, str]]]] = {}

    def feed(self, rank: int, name: str, text: str) -> None:
        key = (name, rank)
        buffered = self._partial.get(key, "") + text
        *lines, rest = buffered.split("\n")
        self._partial[key] = rest
        now = time.monotonic()
        queues = self._pending.setdefault(name, {r: deque() for r in self.ranks})
        queues.setdefault(rank, deque()).extend((now, line) for line in lines)
        self._drain(name, now)

    def poll(self) -> None:
        now = time.monotonic()
        for name in list(self._pending):
            self._drain(name, now)

    def flush(self, rank: int | None = None) -> None:
        """Write every line still waiting, folded where every rank's copy is there.

        ``rank``: only as far as that rank's lines go (before something that rank shows, e.g.
        ``mnb.generate``'s text); the other ranks' lines beyond keep waiting for their copies.
        """
        for (name, r), rest in list(self._partial.items()):
            if rest and (rank is None or r == rank):
                self._pending.setdefault(name, {q: deque() for q in self.ranks}).setdefault(
                    r, deque()
                ).append((0.0, rest))
                self._partial[(name, r)] = ""
        for name in list(self._pending):
            self._drain(name, float("inf"), only=rank)

    def _drain(self, name: str, now: float, only: int | None = None) -> None:
        queues = self._pending[name]
        out: list[str] = []
        while True:
            heads = {r: q[0] for r, q in queues.items() if q}
            if not heads or (only is not None and only not in heads):
                break
            if len(self.ranks) > 1 and len(heads) == len(self.ranks):
                texts = {line for _, line in heads.values()}
                if len(texts) == 1:
                    out.append(f"[{format_rank_set(self.ranks)}] {texts.pop()}\n")
                else:
                    out.extend(f"[{self._label(r)}] {line}\n" for r, (_, line) in sorted(heads.items()))
                for q in queues.values():
                    q.popleft()
                continue
            # Not every rank has spoken: release lines that waited long enough (flush(rank): that rank's).
            expired = [r for r, (t, _) in heads.items() if now - t >= self.fold_window_s or len(self.ranks) == 1]
            if only is not None:
                expired = [only]
            if not expired:
                break
            for r in sorted(expired):
                out.append(f"[{self._label(r)}] {queues[r].popleft()[1]}\n")
        if out:
            self.write(name, "".join(out))

    def _label(self, rank: int) -> str:
        return self.labels.get(rank, f"r{rank}")


def show_bundle(bundle: dict[str, Any]) -> None:
    """Display a MIME bundle in the notebook, or its text where there is none."""
    ipython = ipython_shell()
    if ipython is not None:
        from IPython.display import display

        display(bundle, raw=True)
    else:
        print(bundle.get("text/plain", ""))


PRINT_EVERY_S = 2.0
"""Outside a kernel the progress line is printed at most this often (and at the last step)."""


class ProgressLine:
    """A training progress line updated in place (text where there is no notebook)."""

    def __init__(self) -> None:
        self._handle = None
        self._last_print = 0.0

    def update(self, payload: dict[str, Any]) -> None:
        progress = Progress.from_payload(payload)
        text = progress.line()
        if in_kernel():
            from IPython.display import display

            bundle = {"text/plain": text}
            if self._handle is None:
                self._handle = display(bundle, raw=True, display_id=True)
            else:
                self._handle.update(bundle, raw=True)
        elif time.monotonic() - self._last_print > PRINT_EVERY_S or progress.finished:
            # Terminals and nbclient: a plain line now and then, never a flood.
            print(text)
            self._last_print = time.monotonic()


class GeneratedText:
    """``mnb.generate``'s text as it grows: one output area per prompt, updated in place.

    In a kernel each prompt gets a ``display_id`` and every ``generate`` event updates it
    (Jupyter's ``update_display_data``); elsewhere (terminals, nbclient without a kernel
    display) each prompt's final text is printed once.
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._printed = False
        self.finished = False
        """The call's final text arrived: a later ``generate`` event is another call's."""

    def shows_now(self, payload: dict[str, Any]) -> bool:
        """Whether ``payload`` puts something new in the output (a new area, or the printed text).

        Only then must the lines the ranks printed before be written first; an update in place
        moves nothing, so lines still waiting for the other ranks' copies stay to be folded.
        """
        if in_kernel():
            return len(payload.get("texts") or []) > len(self._handles)
        return bool(payload.get("final")) and not self._printed

    def update(self, payload: dict[str, Any]) -> None:
        self.finished = self.finished or bool(payload.get("final"))
        texts = [str(t) for t in payload.get("texts") or []]
        if in_kernel():
            from IPython.display import display

            for i, text in enumerate(texts):
                bundle = {"text/plain": text}
                if i < len(self._handles):
                    self._handles[i].update(bundle, raw=True)
                else:
                    self._handles.append(display(bundle, raw=True, display_id=True))
        elif payload.get("final") and not self._printed:
            self._printed = True
            for text in texts:
                print(text)
