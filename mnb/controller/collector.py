"""Waiting for one request's replies while streaming output and watching the ranks.

Waiting is not deciding: :meth:`Collector.wait` returns an :class:`Outcome`
(who replied, who failed first, who never finished and where it waited, who
died, whether the cell timed out or was interrupted); only the pool changes
its state or restarts ranks.  Every wait is bounded:

- each 0.1 s (a timer, not per message) it asks the pool whether a rank died;
- the first rank that ends the cell with an exception while others still run
  it is shown at once, labelled as the first failure; if the others have not
  finished ``grace_s`` later, their stacks are fetched and they are
  interrupted;
- past the cell's timeout the same happens to every pending rank;
- Jupyter's interrupt (KeyboardInterrupt in the kernel) is forwarded to the
  ranks as ``interrupt`` messages, and the output still queued for the cell
  is dropped and counted, never replayed into the next cell;
- a rank's ``input()``/``getpass``/pdb prompt is answered with the notebook's stdin
  (``stdin.py``), one rank at a time; the time the user takes pauses the timeout and the
  grace period (the wait is the user's);
- a cell that reaches ranks still finishing their start (Megatron-Core importing after the
  hello, ``mnb/worker/late_start.py``) says so in one line, and the time those ranks take to
  become ready pauses the timeout (the wait is the start's, not the cell's);
- a request another thread cancelled (``Pool.stop``/``restart``: the latch's
  ``cancelled``) ends the wait at once: the ranks are about to be ended;
- an event handler that raises (the live widget's drawing) is logged once per
  request and the wait goes on; any other error while waiting ends the wait
  like an interrupt (the ranks are interrupted and given back), and the pool
  raises it once the rank table is right.

A rank that has not returned a short while after its interrupt is
*unreleased* (blocked in C code or a collective): the pool restarts it.
"""

from __future__ import annotations

import logging
import queue
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mnb.controller.guards import NO_LATCH, InterruptLatch
from mnb.controller.output import GeneratedText, LineFolder, ProgressLine, show_bundle
from mnb.controller.stdin import Ask, StdinServer, ask_kernel
from mnb.paths import in_mnb
from mnb.protocol import Message
from mnb.timeouts import ASK_TIMEOUT_S, DEFERRED_STOP_S, INTERRUPT_ACK_S, INTERRUPT_RELEASE_MAX_S, RELEASE_S

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.1
"""How often the ranks' processes are checked (a timer, never per message)."""
SHOW_FAILURE_AFTER_S = 0.3
"""A first failure is shown once the other ranks have not followed within this long (they often fail alike)."""

EventHandler = Callable[[int, str, dict], None]
"""Called with each rank event; one with a true ``shows_output`` attribute (the live widget) draws into
the cell's output, so a quiet request (no stream, ``pool.run(..., quiet=True)``) leaves it out."""


@dataclass
class Outcome:
    """What happened to one request; the pool decides what follows."""

    replies: dict[int, Message] = field(default_factory=dict)
    first_failure: int | None = None
    """The rank whose error reply came first while other ranks were still running."""
    waiting: dict[int, str] = field(default_factory=dict)
    """Ranks still running the request when the wait was ended (grace, timeout, interrupt):
    where each was, from its stack.  They were interrupted; some may have replied since."""
    stacks: dict[int, str] = field(default_factory=dict)
    collectives: dict[int, Any] = field(default_factory=dict)
    """Every answering rank's collective snapshot (``mnb.megatron.collectives``) when the stacks were
    taken, finished ranks too: their call counts say who skipped a collective (``hangs.py``)."""
    unreleased: list[int] = field(default_factory=list)
    """Ranks still running after their interrupt: they must be restarted."""
    died: bool = False
    timed_out: bool = False
    interrupted: bool = False
    dropped_after_interrupt: dict[int, int] = field(default_factory=dict)
    """Lines of output per rank that arrived once the cell was being stopped: dropped, never shown
    (they would otherwise spill into the next cell)."""
    dropped_overflow: int = 0
    """Lines dropped while the cell ran: the ranks printed faster than the notebook showed them
    (``transport.STREAM_QUEUE_MAX_CHARS`` queued characters at most)."""
    timeout_s: float | None = None
    """The timeout that ended the wait (``timed_out``)."""
    last_step_time_s: float | None = None
    cancelled: str | None = None
    """Why another thread ended the wait (``Pool.stop``: the ranks were not interrupted)."""
    error: Exception | None = None
    """What went wrong in the notebook kernel while waiting (the ranks were interrupted first)."""
    shown_traceback: str = ""
    """The first failure's traceback, printed while other ranks still ran: the cell's error refers
    to it instead of printing it a second time."""

    @property
    def pending(self) -> list[int]:
        return sorted(self.waiting)

    @property
    def dropped_lines(self) -> int:
        return sum(self.dropped_after_interrupt.values()) + self.dropped_overflow

    def drop_muted(self, message: Message) -> None:
        """Count a stream message of a cell being stopped as dropped (by rank)."""
        rank = message.get("rank")
        self.dropped_after_interrupt[rank] = (self.dropped_after_interrupt.get(rank, 0)
                                              + (message["text"].count("\n") or 1))


class Collector:
    """Waits for one request's replies while streaming output and watching the ranks."""

    def __init__(
        self,
        transport: Any,
        request_id: str,
        targets: list[int],
        labels: dict[int, str],
        *,
        timeout_s: float | None,
        grace_s: float,
        stream: bool,
        any_dead: Callable[[], bool],
        event_handlers: list[EventHandler],
        on_stray: Callable[[Message], None],
        ask: Ask = ask_kernel,
    ):
        self.transport = transport
        self.request_id = request_id
        self.targets = targets
        self.labels = labels
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.any_dead = any_dead
        self.event_handlers = event_handlers
        self.on_stray = on_stray
        self.outcome = Outcome()
        self.folder = LineFolder(targets, labels) if stream else None
        self.progress: ProgressLine | None = None
        self.stdin = StdinServer(transport, request_id, labels, ask=ask)
        self.generated: GeneratedText | None = None
        self._muted = False  # after an interrupt: count the cell's output, show none
        self._failed_at: float | None = None
        self._unshown: Message | None = None  # the first failure, until it is shown
        self._latch: InterruptLatch = NO_LATCH
        self._failed_handlers: set[int] = set()  # id() of the handlers that raised in this request
        self._starting: set[int] = set()  # ranks whose cell waits for their start (``starting`` event)
        self._paused_from: float | None = None  # since when a rank's start pauses the timeout
        self._paused_total_s = 0.0
        self._said_starting = False

    # ------------------------------------------------------------------ wait
    def wait(self, latch: InterruptLatch = NO_LATCH) -> Outcome:
        """Wait until every target replied or the wait had to end; never raises KeyboardInterrupt.

        Interrupts come from ``latch`` (the request's, see guards.py), taken between
        steps of the loop; a KeyboardInterrupt raised anyway (no latch) counts too.
        """
        self._latch = latch
        start = time.monotonic()
        next_check = start
        interrupted = False
        try:
            while self._pending():
                if latch.cancelled:
                    self.outcome.cancelled = latch.cancelled
                    return self._finish()
                if latch.take():
                    interrupted = True
                    break
                now = time.monotonic()
                if self.timeout_s is not None and now - start - self._paused_s(now) > self.timeout_s:
                    self.outcome.timed_out, self.outcome.timeout_s = True, self.timeout_s
                    return self._end(release_s=RELEASE_S)
                if self._failed_at is not None:
                    if now - self._failed_at > self.grace_s:
                        return self._end(release_s=RELEASE_S)
                    if self._unshown is not None and now - self._failed_at >= SHOW_FAILURE_AFTER_S:
                        self._show_first_failure()
                self._step(0.05)
                if self.stdin.next_rank() is not None:
                    if self.folder:
                        self.folder.flush()  # what the rank printed before it asked comes first
                    began = time.monotonic()
                    stop = self.stdin.serve()
                    spent = time.monotonic() - began  # the user's time: not the cell's timeout or grace
                    start += spent
                    if self._failed_at is not None:
                        self._failed_at += spent
                    if stop:
                        interrupted = True
                        break
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + CHECK_INTERVAL_S
                    if self.any_dead():
                        self.outcome.died = True
                        return self._finish()
        except KeyboardInterrupt:
            interrupted = True
        except Exception as exc:  # the kernel's side broke: give the ranks back, then the pool raises it
            log.debug("waiting for request %s failed", self.request_id, exc_info=True)
            self.outcome.error = exc
            interrupted = True
        if interrupted:
            self.outcome.interrupted = True
            self._muted = True
            return self._end(release_s=self._interrupt_release_s(), stacks_first=False)
        return self._finish()

    def _interrupt_release_s(self) -> float:
        """An interrupted mnb.train stops at the next step boundary: allow that step to end."""
        step = self.outcome.last_step_time_s or 0.0
        return min(INTERRUPT_RELEASE_MAX_S, max(self.grace_s, RELEASE_S) + 2 * step)

    def _end(self, release_s: float, stacks_first: bool = True) -> Outcome:
        """Interrupt the pending ranks and wait ``release_s`` for them; record where they were."""
        self.stdin.close("the cell is being stopped")
        pending = self._pending()
        if stacks_first and pending:
            self._take_stacks(pending)
        deferred = False
        if pending:
            answers = self.transport.ask("interrupt", pending, INTERRUPT_ACK_S)
            deferred = any(answer.get("deferred") for answer in answers.values())
        # A user's interrupt lets mnb.train finish its step on every rank first.  After a rank
        # failed or the cell timed out the others wait in a collective that cannot complete:
        # they get the usual release time, then count as unreleased and are restarted (waiting
        # DEFERRED_STOP_S here made a failed pipeline cell take 305 s to report).
        deferred = deferred and self.outcome.interrupted
        if deferred:
            release_s = max(release_s, DEFERRED_STOP_S)
        deadline = time.monotonic() + release_s
        next_check, announce_at = time.monotonic(), time.monotonic() + 1.0
        while self._pending() and time.monotonic() < deadline:
            try:
                self._step(0.05)
                now = time.monotonic()
                if deferred and announce_at and now >= announce_at:
                    announce_at = 0.0
                    sys.stderr.write("mnb: stopping mnb.train after its current step on every rank "
                                     "(interrupt again to stop at once: the ranks are then restarted)\n")
                if now >= next_check:
                    next_check = now + CHECK_INTERVAL_S
                    if self.any_dead():
                        self.outcome.died = True
                        break
                if self._latch.cancelled:
                    self.outcome.cancelled = self._latch.cancelled
                    break
                second = self._latch.take()
            except KeyboardInterrupt:
                second = True
            except Exception as exc:  # as in wait(): stop showing, keep giving the ranks back
                self.outcome.error = self.outcome.error or exc
                self._muted, second = True, False
            if second:  # a second interrupt while the first takes effect
                self._muted = True
                if deferred:
                    break
        still = self._pending()
        ending = self.outcome.died or self.outcome.cancelled  # the ranks go anyway: nothing to release
        if still and not self.outcome.stacks and not ending:
            self._take_stacks(still)
        self.outcome.unreleased = [] if ending else still
        return self._finish(where_for=pending)

    def _take_stacks(self, pending: list[int]) -> None:
        """The pending ranks' stacks, and every target's collective counts (finished ranks answer at once)."""
        answers = self.transport.ask("stacks", self.targets, ASK_TIMEOUT_S)
        self.outcome.stacks = _stack_texts({r: m for r, m in answers.items() if r in pending})
        self.outcome.collectives = {r: m.get("collectives") for r, m in answers.items()}

    def _finish(self, where_for: list[int] | None = None) -> Outcome:
        self.stdin.close(self.outcome.cancelled or "the cell has ended")
        if self.folder:
            self.folder.flush()
        for rank in (where_for if where_for is not None else self._pending()):  # as they were when stopped
            self.outcome.waiting[rank] = last_frame(self.outcome.stacks.get(rank, "")) or "(no stack: no answer)"
        self._drop_queued_output()
        self.outcome.dropped_overflow += self.transport.take_dropped(self.request_id)
        return self.outcome

    def _drop_queued_output(self) -> None:
        """Output of this cell still queued is counted and dropped once the cell ends."""
        while True:
            try:
                message = self.transport.inbox.get_nowait()
            except queue.Empty:
                return
            if message.type == "stream" and message.get("cell") == self.request_id and self._muted:
                self.outcome.drop_muted(message)
            else:
                self._handle(message)

    def _pending(self) -> list[int]:
        return [r for r in self.targets if r not in self.outcome.replies]

    def _paused_s(self, now: float) -> float:
        """Seconds the cell's timeout was paused so far: ranks finishing their start before the cell ran."""
        return self._paused_total_s + (now - self._paused_from if self._paused_from is not None else 0.0)

    def _on_starting(self, rank: int, kind: str, payload: dict[str, Any]) -> None:
        """A rank's cell waits for its start (``starting``), or no longer does (``started``, or its reply)."""
        now = time.monotonic()
        if kind == "starting":
            if not self._starting:
                self._paused_from = now
            self._starting.add(rank)
            if not self._said_starting and self.folder is not None and not self._muted:
                self._said_starting = True
                self.folder.flush()
                doing = str(payload.get("doing") or "starting")
                if doing.startswith("waiting for "):  # a rank done with its part waits for the others
                    what = doing
                else:  # "importing X", "building X": the ranks are still at it
                    what = f"waiting for the ranks to finish {doing}"
                print(f"mnb: {what} (under way for {payload.get('elapsed_s', 0):.1f} s)...", flush=True)
            return
        self._starting.discard(rank)
        if not self._starting and self._paused_from is not None:
            self._paused_total_s += now - self._paused_from
            self._paused_from = None

    # ------------------------------------------------------------- messages
    def _step(self, wait_s: float) -> None:
        try:
            message = self.transport.get(timeout=wait_s)
        except queue.Empty:
            message = None
        if message is not None:
            self._handle(message)
        if self.folder and not self._muted:
            self.folder.poll()

    def _handle(self, message: Message) -> None:
        rank = message.get("rank")
        if message.type == "reply":
            if message.id != self.request_id or rank not in self.targets:
                self.on_stray(message)
                return
            self.outcome.replies[rank] = message
            self.stdin.finished(rank)
            if rank in self._starting:  # its wait was interrupted: no ``started`` event comes
                self._on_starting(rank, "started", {})
            if not message.get("ok") and self._failed_at is None:
                self._on_first_failure(rank, message)
        elif message.type == "input_request":  # another cell's is refused there: its rank must not hang
            self.stdin.add(message)
        elif message.get("cell") not in (None, self.request_id):
            self.on_stray(message)
        elif message.type == "stream":
            if self._muted:
                self.outcome.drop_muted(message)
            elif self.folder and rank in self.folder.labels:
                self.folder.feed(rank, message["name"], message["text"])
        elif message.type == "display":
            if not self._muted:
                if self.folder:
                    self.folder.flush()
                show_bundle(message.payload or {})
        elif message.type == "event":
            self._on_event(rank, message.get("kind"), message.payload or {})
        else:
            self.on_stray(message)

    def _on_first_failure(self, rank: int, reply: Message) -> None:
        self._failed_at = time.monotonic()
        if not self._pending() or self.outcome.interrupted or reply.get("ename") == "KeyboardInterrupt":
            return
        self.outcome.first_failure = rank
        self._unshown = reply

    def _show_first_failure(self) -> None:
        """The root cause, at once: the other ranks may wait for the failed one in a collective.

        Replies already queued are taken first: when every rank has failed (a loaded machine
        delivers them late) nothing is printed here, the cell's error shows them all folded,
        and no line claims that finished ranks are about to be stopped.
        """
        reply, self._unshown = self._unshown, None
        self._take_queued()
        others = self._pending()
        if not others:
            return
        rank = reply.get("rank")
        if self.folder:
            self.folder.flush()
        text = (reply.get("traceback") or f"{reply.get('ename')}: {reply.get('evalue')}").rstrip("\n")
        self.outcome.shown_traceback = text
        sys.stderr.write(
            f"[{self.labels.get(rank, f'r{rank}')}] failed first:\n{text}\n"
            f"mnb: rank(s) {others} still running: they are stopped unless they finish within {self.grace_s:g} s\n"
        )
        sys.stderr.flush()

    def _take_queued(self) -> None:
        """Handle every message already in the inbox, without waiting for more."""
        while True:
            try:
                message = self.transport.inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(message)

    def _on_event(self, rank: int, kind: str, payload: dict[str, Any]) -> None:
        if kind in ("starting", "started"):  # the rank's start, not the cell's (handlers see it too)
            self._on_starting(rank, kind, payload)
        if kind == "progress" and payload.get("step_time_s"):
            self.outcome.last_step_time_s = payload["step_time_s"]
        if self._muted:
            return
        quiet = self.folder is None  # pool.run(..., quiet=True): no output, so no widget and no text line
        for handler in list(self.event_handlers):
            if quiet and getattr(handler, "shows_output", False):
                continue
            try:
                handler(rank, kind, payload)
            except Exception:  # a drawing that fails must not end a training the ranks go on with
                if id(handler) not in self._failed_handlers:
                    self._failed_handlers.add(id(handler))
                    log.exception("the event handler %r raised on a %r event of rank %s; the request goes on "
                                  "(its later errors in this request are not logged)", handler, kind, rank)
        if kind == "generate" and self.folder is not None:  # mnb.generate(..., stream=True)
            if self.generated is None or self.generated.finished:  # a cell's next mnb.generate: its own areas
                self.generated = GeneratedText()
            if self.generated.shows_now(payload):  # what this rank printed before comes first; updates in
                self.folder.flush(rank)            # place, and other ranks' later lines, wait to fold
            self.generated.update(payload)
        if kind == "progress" and not self.event_handlers and not quiet:
            self.progress = self.progress or ProgressLine()
            self.progress.update(payload)


def _stack_texts(answers: dict[int, Message]) -> dict[int, str]:
    return {rank: message.get("stacks", "") for rank, message in answers.items()}


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def _frames(stack_text: str) -> list[tuple[str, str, str, str]]:
    """(file, line, function, source) of each frame of a stack or traceback text, outermost first."""
    frames: list[tuple[str, str, str, str]] = []
    lines = stack_text.splitlines()
    for index, line in enumerate(lines):
        match = _FRAME.match(line)
        if match:
            code = lines[index + 1].strip() if index + 1 < len(lines) and not _FRAME.match(lines[index + 1]) else ""
            frames.append((match["file"], match["line"], match["func"], code))
    return frames


def last_frame(stack_text: str) -> str:
    """Where a stack (or traceback) stands: the innermost line of the user's code (:func:`user_place`),
    then the innermost frame when that is another (where a call into a library waits).

    e.g. ``cell line 3 `dist.all_reduce(x)` -> distributed_c10d.py:3252 in all_reduce``;
    ``train.py line 12 `done.wait()` -> threading.py:327 in wait``.
    """
    frames = _frames(stack_text)
    if not frames:
        return ""
    inner = frames[-1]
    where = f"{inner[0].rsplit('/', 1)[-1]}:{inner[1]} in {inner[2]}"
    place = user_place(stack_text)
    if not place:
        return where + (f": {inner[3]}" if inner[3] else "")
    return place if _users(inner[0]) else f"{place} -> {where}"


_LIBRARY = re.compile(r"/lib/python3\.\d+/|/(site|dist)-packages/|/mnb/(worker|megatron|controller|plot|widgets)/")
"""A frame of the standard library, an installed package or mnb itself (also on a rank whose paths differ)."""


def _users(path: str) -> bool:
    if path.startswith("<"):  # <cell-3> is the user's; <frozen runpy>, <string> are not
        return path.startswith("<cell-")
    return not in_mnb(path) and not _LIBRARY.search(path)


def user_place(stack_text: str) -> str:
    """Where in the user's own code a stack (or traceback) stands: its innermost frame of a cell
    (``cell line 4 `dist.barrier()` ``) or of the user's files, a script of ``%mnb run`` or a module
    beside it (``train.py line 12 `dist.barrier()` ``); never a frame of mnb, the standard library
    or an installed package.  "" when no frame is the user's (mnb was starting or ending the cell).
    """
    for path, line, _, code in reversed(_frames(stack_text)):
        if _users(path):
            name = "cell" if path.startswith("<cell-") else path.rsplit("/", 1)[-1]
            return f"{name} line {line}" + (f" `{code}`" if code else "")
    return ""
