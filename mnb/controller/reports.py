"""What the notebook is told when a request did not simply succeed.

Pure functions from an :class:`~mnb.controller.collector.Outcome` (and the
ranks' labels) to text or to the one error a cell ends with; the pool decides
what to repair and passes the line that says so (``note``).  Every message
says what happened, where each rank was, and what happens next.
"""

from __future__ import annotations

import signal

from mnb.controller import hangs
from mnb.controller.collector import Outcome, user_place
from mnb.controller.launcher import describe_exit
from mnb.errors import CompositeRankError, RankError, format_rank_set

Labels = dict[int, str]
"""rank -> 'r1 tp0 pp0 dp1'"""
FAULT_TRACEBACK_LINES = 12
"""Lines of a dying rank's traceback (its ``fatal`` message) shown in the death report."""


def interrupt_line(outcome: Outcome, targets: list[int], labels: Labels) -> str:
    """Every interrupt in one shape: which ranks, where in the user's code, and what was dropped and why.

    First the ranks that could not be stopped (stuck in C code or a collective): where each was
    stuck (its innermost line of the cell or script, then the call it waits in).  Then the ranks
    the interrupt stopped, grouped by where in the user's code each was
    (:func:`~mnb.controller.collector.user_place`: a cell or script line, never mnb's or the
    standard library's frame), or mnb.train's step; then the ranks that had finished before it
    reached them; then the output that was dropped, by reason.
    """
    replies = {r: outcome.replies[r] for r in targets if r in outcome.replies}
    stuck = [r for r in outcome.unreleased if r in targets]
    parts = [f"rank {r} ({labels.get(r, f'r{r}')}) did not stop: stuck at {outcome.waiting.get(r) or '(no stack)'}"
             + "".join(f"; in {text}" for text in hangs.waiting_in(outcome.collectives.get(r)))
             for r in stuck]
    train = {m.get("evalue") for m in replies.values() if str(m.get("evalue", "")).startswith("mnb.train stopped")}
    finished = sorted(r for r, m in replies.items() if m.get("ok"))
    if train:  # the same step on every rank, stopped in the same cell line
        place = next(filter(None, (user_place(m.get("traceback", "")) for m in replies.values())), "")
        parts.append(f"interrupted rank(s) {sorted(replies)}" + (f" at {place}" if place else "")
                     + f": {sorted(train)[0]}")
    else:
        places: dict[str, list[int]] = {}
        for rank in sorted(r for r in replies if r not in finished):
            place = user_place(replies[rank].get("traceback", ""))
            where = f"at {place}" if place else "outside the user's code (while mnb started or ended the cell)"
            places.setdefault(where, []).append(rank)
        if places:
            parts.append("interrupted " + ", ".join(f"rank(s) {ranks} {where}" for where, ranks in places.items()))
        if finished:
            parts.append(f"rank(s) {finished} had finished")
    text = "; ".join(parts)
    dropped = dropped_text(outcome)
    if dropped:
        text += f" ({dropped})"
    if stuck:  # what the ranks' call counts say, one line per group that cannot go on
        text += "".join(f"\n{line}" for line in hangs.diagnose(outcome.collectives))
    return text


def dropped_text(outcome: Outcome) -> str:
    """What output a stopped cell dropped and why ("" when none was)."""
    said = []
    late = outcome.dropped_after_interrupt
    if late:
        ranks = sorted(r for r in late if r is not None)
        said.append(f"{sum(late.values()):,} line(s) of output from rank(s) {ranks} that arrived after the "
                    "interrupt were dropped, so that none spills into the next cell")
    if outcome.dropped_overflow:
        said.append(f"{outcome.dropped_overflow:,} line(s) of output were dropped while the cell ran: the ranks "
                    "printed faster than the notebook could show")
    return "; ".join(said)


def timeout_text(outcome: Outcome, targets: list[int], labels: Labels, note: str) -> str:
    """Who had not finished at the timeout, where each waited, their stacks, and what follows."""
    pending = outcome.pending
    lines = [f"cell timed out after {outcome.timeout_s:g} s; rank(s) {pending} had not finished."]
    places: dict[str, list[int]] = {}
    for rank in pending:
        places.setdefault(outcome.waiting[rank], []).append(rank)
    lines += [f"  [{labels[ranks[0]] if len(ranks) == 1 else format_rank_set(ranks)}] at {where}"
              for where, ranks in places.items()]
    finished = [r for r in targets if r not in pending]
    if finished:
        lines.append(f"  rank(s) {finished} had finished (did they skip a collective the others wait in?)")
    lines += [f"  {line}" for line in hangs.report_lines(outcome.collectives, pending, labels)]
    grouped: dict[str, list[int]] = {}
    for rank, text in outcome.stacks.items():
        grouped.setdefault(text, []).append(rank)
    for text, members in grouped.items():
        lines.append(f"\nPython stack of [{format_rank_set(members)}]:")
        lines.append(text.rstrip())
    lines.append("\n" + (note or "All ranks were interrupted; the pool is usable."))
    return "\n".join(lines)


def failure_error(errors: list[RankError], outcome: Outcome, targets: list[int], labels: Labels,
                  note: str) -> CompositeRankError:
    """The cell's failures, root cause first, then where the ranks that had not finished were."""
    waiting = {r: f"[{labels[r]}] was still running at {where}" + "".join(
                   f"; in {text}" for text in hangs.waiting_in(outcome.collectives.get(r)))
               for r, where in outcome.waiting.items()}
    if outcome.waiting and not note:
        note = f"rank(s) {sorted(outcome.waiting)} were interrupted; the pool is usable."
    raised = {e.rank: e.ename for e in errors if e.rank not in outcome.waiting}  # not skipped: they raised
    notes = hangs.diagnose(outcome.collectives, raised) if outcome.waiting else []
    return CompositeRankError(errors, cell_ranks=targets, waiting=waiting, notes=notes + ([note] if note else []),
                              shown_above=outcome.shown_traceback)


TORN_DOWN = describe_exit(-signal.SIGTERM)
"""How torchrun ends the survivors of a failure (``launcher.describe_exit``'s words for it)."""


def death_lines(deaths: dict[int, str], labels: Labels) -> tuple[list[str], list[int]]:
    """'rank 1 (r1 tp0 pp0 dp1) died: exit code 3 (pid 42)' per rank, the first failures first.

    ``deaths``: :meth:`Launcher.deaths <mnb.controller.launcher.Launcher.deaths>`' account of each
    rank.  torchrun SIGTERMs the survivors of a failure: while another rank ended otherwise, those
    are said to be torn down, not killed (when every rank got SIGTERM, it came from outside and none
    failed first).  Returns the lines (ranks without a label left out) and the ranks that failed first.
    """
    torn = {r for r, why in deaths.items() if why.startswith(TORN_DOWN)}
    if len(torn) == len(deaths):
        torn = set()
    ordered = sorted(deaths, key=lambda r: (r in torn, r))
    lines = [f"rank {r} ({labels[r]}) died: "
             + (f"torn down by torchrun after the failure ({deaths[r]})" if r in torn else deaths[r])
             for r in ordered if r in labels]
    return lines, [r for r in ordered if r not in torn]


def last_words(message) -> str:
    """A rank's ``fatal`` message in words: what its start was doing after the hello, and the error.

    e.g. ``its start failed after it said hello: importing Megatron-Core raised ImportError: no module``
    """
    return (f"its start failed after it said hello: {message.get('doing') or 'the start'} raised "
            f"{message.get('ename')}: {message.get('evalue')}")


def last_words_lines(messages: dict, shown: int = FAULT_TRACEBACK_LINES) -> list[str]:
    """The last lines of each dying rank's traceback (``fatal``), for the death report."""
    lines: list[str] = []
    for rank, message in sorted(messages.items()):
        tail = (message.get("traceback") or "").rstrip("\n").splitlines()[-shown:]
        if tail:
            lines += [f"rank {rank}'s traceback (last {len(tail)} lines; all of it in the torchrun log):", *tail]
    return lines


FAULT_FRAMES = 8
"""Frames of a crashed thread shown in the death report (the fault file keeps them all)."""


def fault_lines(text: str, cell_code: str | None = None) -> list[str]:
    """The death report's view of a fault file (Python's faulthandler output, :mod:`mnb.worker.faults`).

    The fatal error, then the thread the signal arrived on and, when that is another one (a C++
    thread of a communication library has no Python frames), the thread that ran the cell: most
    recent call first, ``FAULT_FRAMES`` of them, the cell's own lines with their source from
    ``cell_code``.  ``[]`` when the file holds no fault.
    """
    fatal, threads = "", []  # threads: (is_current, frames)
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("Fatal Python error"):
            fatal = stripped
        elif stripped.endswith("(most recent call first):") and "hread" in stripped:
            threads.append((stripped.startswith("Current thread"), []))
        elif threads and line.startswith("  ") and stripped:
            threads[-1][1].append(stripped)
    if not fatal and not threads:
        return []
    source = (cell_code or "").splitlines()

    def shown(frames: list[str]) -> list[str]:
        cell = [i for i, f in enumerate(frames) if '"<cell-' in f]
        if cell:  # what lies below the cell is mnb's own rank loop
            frames = frames[: cell[-1] + 1]
        out = []
        for frame in frames[:FAULT_FRAMES]:
            where = frame.removeprefix("File ").replace('"', "")
            if where.startswith("<cell-") and ", line " in where:
                number = where.split(", line ", 1)[1].split()[0]
                if number.isdigit() and 0 < int(number) <= len(source):
                    where += f": {source[int(number) - 1].strip()}"
            out.append(f"    {where}")
        if len(frames) > FAULT_FRAMES:
            out.append(f"    ... {len(frames) - FAULT_FRAMES} more")
        return out

    def runs_cell(frames: list[str]) -> bool:
        return any('"<cell-' in f or "mnb/worker/script.py" in f for f in frames)

    lines = [f"  {fatal}"] if fatal else []
    current = next((frames for is_current, frames in threads if is_current), None)
    cell = next((frames for _, frames in threads if runs_cell(frames)), None)
    python = [f for f in current or [] if f != "<no Python frame>"]
    if python:
        lines += ["  in the thread that crashed, most recent call first:"] + shown(python)
    elif threads:  # faulthandler marks no thread current when the signal came on one Python never ran
        lines.append("  the thread that crashed runs no Python (a C/C++ thread: gloo's or NCCL's, a native "
                     "extension's)")
    if cell is not None and cell is not current:
        lines += ["  the thread running the cell was at, most recent call first:"] + shown(cell)
    return lines
