"""The request path: one request from its targets to the one error the notebook sees.

``run``, ``run_script``, ``push``, ``pull`` and ``debug`` (the request API that
:class:`~mnb.controller.pool.Pool` composes and hands on) each pass the gate
(``exclusive``), wait for a restart under way (the repair part), mark their
ranks busy, send, let the :class:`~mnb.controller.collector.Collector` wait,
take in the replies (values, layout, run records for ``mnb.last_run``) and turn
the outcome into an error after the repair part acted on it (``Repair.after``).
"""

from __future__ import annotations

import logging
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from mnb.config import ParallelConfig
from mnb.controller import reports
from mnb.controller.collector import Outcome
from mnb.controller.gate import RequestGate, exclusive
from mnb.controller.generation import Generation, RankInfo
from mnb.controller.launcher import LaunchSpec
from mnb.controller.registry import record_training
from mnb.controller.repair import Repair
from mnb.errors import (CellTimeoutError, CompositeRankError, PoolError, RankDiedError, RankError, RequestRefused,
                        interrupted)
from mnb.fields import check_ranks, check_seconds
from mnb.protocol import Message
from mnb.timeouts import DEATH_REPORT_WAIT_S, REMOTE_RANK_SILENCE_S, VALUES_TIMEOUT_S
from mnb.units import cwd_note
from mnb.values import ValueDecodeError, decode_values, encode_push

log = logging.getLogger(__name__)


def check_code(code: Any) -> None:
    """A cell's code is Python text: TypeError for anything else, before anything is sent."""
    if isinstance(code, str):
        return
    hint = "; decode it first: code.decode()" if isinstance(code, (bytes, bytearray)) else ""
    raise TypeError(f"code must be a str of Python source, got {type(code).__name__} ({code!r:.60}){hint}")


def check_timing(timeout: Any, grace: Any) -> None:
    """A request's ``timeout`` (None: the pool's) and ``grace`` (None: the pool's), by the rule the magics'
    ``--timeout``/``--grace`` use (:func:`mnb.fields.check_seconds`)."""
    if timeout is not None:
        check_seconds(timeout, "timeout", zero_ok=False)
    if grace is not None:
        check_seconds(grace, "grace", zero_ok=True)


@dataclass(frozen=True)
class Sealed:
    """A request's message, numbered (a cell) and signed once for the generation it goes to (:meth:`Requests._seal`)."""

    message: Message
    frames: list[bytes]
    generation: Generation


@dataclass(frozen=True)
class KeptFailure:
    """The root cause of the last failed cell: its rank keeps the frames while ``generation`` lives."""

    rank: int
    what: str
    generation: Any


class Requests:
    """The request API and the state only requests change: the layout requests run under, the last
    cell's records, profile folder and failure, and the cells' numbers.

    :class:`~mnb.controller.pool.Pool` composes it beside the two parts it shares with them, the
    request gate (one request at a time) and the repair part (the current generation of processes,
    what follows each outcome), and hands its methods and this state on under the same names.
    """

    def __init__(self, spec: LaunchSpec, gate: RequestGate, repair: Repair, *, cell_timeout_s: float | None,
                 grace_s: float):
        self.spec = spec
        self._gate = gate
        self._repair = repair
        self.cell_timeout_s = cell_timeout_s
        """A cell's timeout when the request names none (None: no limit)."""
        self.grace_s = grace_s
        """Seconds the other ranks may take after one failed, when the request names none."""
        self.layout = ParallelConfig().resolve(spec.world_size)
        """The layout requests run under; during an automatic restart, the one the new ranks will have."""
        self.event_handlers: list[Callable[[int, str, dict], None]] = []
        """Called with each rank event (``(rank, kind, payload)``) while a request runs: the widgets' views."""
        self.last_cell_records: list[dict[str, Any]] = []
        """The run records of the last cell or script, from its replies."""
        self.last_cell_profile: str | None = None
        """The folder the ranks wrote the last cell's profile to, from their replies (None: none)."""
        self.last_failure: KeptFailure | None = None
        """The root cause of the last failed cell, for ``%mnb debug``."""
        self._stray_lines = 0
        self._cells_sent = 0
        """``execute`` requests sent: the next one's number (the ranks' ``<cell-N>``) follows, the same on every rank."""

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def ranks(self) -> dict[int, RankInfo]:
        """The current generation's rank table (:attr:`Repair.ranks`)."""
        return self._repair.ranks

    @exclusive
    def run(
        self,
        code: str,
        ranks: Iterable[int] | None = None,
        timeout: float | None = None,
        *,
        layout: ParallelConfig | None = None,
        display_ranks: Iterable[int] = (0,),
        show_result: bool = False,
        want_value: bool = True,
        quiet: bool = False,
        grace: float | None = None,
        kernel: dict[str, Any] | None = None,
        profile: dict[str, Any] | None = None,
        debug_ranks: Iterable[int] | None = None,
    ) -> dict[int, Any]:
        """Run ``code`` on ``ranks`` (all by default); return {rank: value of the last expression}.

        Output streams live, labelled by rank.  An exception on any rank raises
        one :class:`CompositeRankError`, the first failure first; ranks still
        running ``grace`` seconds (default: the pool's) after a failure are
        stopped and reported with where they waited.  Past ``timeout`` seconds a
        :class:`CellTimeoutError` carries each stuck rank's stack.  Figures and
        ``display()`` calls of ``display_ranks`` appear inline; with
        ``show_result`` (as ``%%megatron`` does) so does the last expression.  ``want_value=False`` (what
        ``%%megatron`` asks, which shows the result and returns nothing): no rank sends its value, each is
        None here.  A value over the protocol's limit of one message stays on its rank and arrives as an
        ``Unportable`` note saying so.  ``kernel``: the
        notebook's environment changes for the ranks (``mnb.controller.kernel_context``).
        ``profile``: ``{"dir", "steps", "ranks"}`` to profile the cell (``mnb.megatron.profile``).
        A rank's ``input()`` and pdb prompt are answered with the notebook's stdin
        (``mnb.controller.stdin``); ``debug_ranks``: only these ranks stop at ``breakpoint()``
        and ``pdb.set_trace()`` (default: every rank).  A failed rank keeps its frames for
        :meth:`debug` until its next cell.

        Refused before anything is sent (TypeError/ValueError naming the argument): ``code`` that is not
        a str, ``timeout`` that is not a positive number of seconds, ``grace`` that is negative.
        """
        check_code(code)
        check_timing(timeout, grace)
        self.last_cell_profile = None  # until this cell's replies say which folder its ranks wrote
        targets = self._prepare_request(ranks)
        header: dict[str, Any] = {
            "code": code, "display_ranks": list(display_ranks), "want_value": bool(want_value),
            "show_result": show_result,
        }
        if kernel:
            header["kernel"] = kernel
        if profile:
            header["profile"] = profile
        if debug_ranks is not None:
            header["debug_ranks"] = sorted(set(debug_ranks))
        changed: ParallelConfig | None = None
        if layout is not None:
            try:
                resolved = layout.resolve(self.world_size)
            except ValueError as exc:
                raise RequestRefused(str(exc)) from None
            if resolved != self.layout:
                if len(targets) != self.world_size:
                    raise RequestRefused(
                        f"changing the layout ({self.layout.describe()} -> {resolved.describe()}) "
                        f"needs every rank, but the cell runs on {len(targets)} of {self.world_size}; "
                        "drop --ranks or change the layout in a cell of its own"
                    )
                header["layout"] = resolved.as_dict()
                changed = resolved
        sealed = self._seal("execute", header)  # a cell too large to send is refused here, the pool as it was
        if changed is not None:
            for rank in targets:  # label this cell's output with the coordinates it will have
                self.ranks[rank].coords = changed.coordinates(rank)
            self.layout = changed
        outcome = self._exchange(sealed, targets, timeout=timeout, stream=not quiet, grace=grace)
        errors, values = self._absorb(outcome)
        unlaid = self._confirm_layout(outcome)
        self._keep_failure(targets, errors, died=outcome.died)
        self._raise_for(outcome, targets, errors, code=code, unlaid=unlaid)
        return values

    def _confirm_layout(self, outcome: Outcome) -> list[int]:
        """The cell's layout, decided once in :meth:`run` (``self.layout``), against what the replies say.

        Each reply names the layout its rank has (None: interrupted inside a change, no groups at
        all).  Only when every rank replied with one other layout (the change failed on all of them
        alike) does the pool take the ranks' word; otherwise the cell's layout stays, whatever reply
        came first: it is the one an automatic restart promises and restores.  Returns the ranks
        that kept another layout, or none, while the cell's stands: the pool cannot run on them.
        """
        said = {r: m.get("layout") for r, m in outcome.replies.items() if "layout" in m.header}
        bare = [r for r, layout in said.items() if not layout]  # a rank with no groups agrees with no one
        kept = {r: ParallelConfig(**layout) for r, layout in said.items() if layout}
        others = [r for r, layout in kept.items() if layout != self.layout]
        if not others and not bare:
            return []
        if not bare and len(others) == self.world_size and all(kept[r] == kept[others[0]] for r in others):
            self.layout = kept[others[0]]
            for rank in others:
                self.ranks[rank].coords = outcome.replies[rank].get("coords") or self.ranks[rank].coords
            return []
        return sorted(others + bare)

    def _keep_failure(self, targets: list[int], errors: list[RankError], died: bool = False) -> None:
        """Remember the root-cause rank of a failed cell for ``%mnb debug`` (its rank keeps the frames).

        A cell that ended in a death keeps the earlier record: ``debug`` then says the frames went
        with the replaced processes, rather than that nothing failed."""
        kept = self.last_failure
        if kept is not None and kept.rank in targets and not died:  # that rank ran another cell
            self.last_failure = None
        if errors:
            first = errors[0]
            self.last_failure = KeptFailure(first.rank, f"{first.ename}: {first.evalue}", self._repair.generation)

    @exclusive
    def debug(self, rank: int | None = None) -> None:
        """Post-mortem pdb on the frame where ``rank``'s last cell failed (what ``%mnb debug [RANK]`` does).

        Default rank: the root cause (first failure) of the last failed cell.  The prompts and
        answers go through the notebook's stdin (``mnb.controller.stdin``), as ``breakpoint()``'s
        do.  A rank keeps its failure until its next cell, and only while its process lives: after a
        restart this raises :class:`~mnb.errors.RequestRefused` saying why the frames are gone.
        """
        kept = self.last_failure
        if rank is None and kept is None:
            raise RequestRefused("no failed cell to debug: %mnb debug looks at the last cell that failed on "
                                 "a rank (run one, or name a rank: %mnb debug 1)")
        rank = kept.rank if rank is None else rank
        targets = self._prepare_request([rank])  # a restart under way is waited for: then the generation is the new one
        if kept is not None and kept.generation is not self._repair.generation:
            raise RequestRefused(
                f"the frames of rank {kept.rank}'s {kept.what} are gone: its process was replaced since "
                f"({self._repair.replaced_why or 'the pool restarted'}); run the failing cell again, then %mnb debug")
        outcome = self._exchange(self._seal("execute", {"code": "", "post_mortem": True, "want_value": False}),
                                 targets, timeout=None)
        reply = outcome.replies.get(rank)
        errors = [self._rank_error(rank, reply)] if reply is not None and not reply.get("ok") else []
        self._raise_for(outcome, targets, errors)
        if reply is not None and not reply.get("kept"):
            raise RequestRefused(f"rank {rank} keeps no failed traceback: its last cell did not fail there "
                                 "(a rank keeps one until its next cell)")

    @exclusive
    def run_script(
        self,
        path: str | os.PathLike,
        args: Iterable[str] = (),
        ranks: Iterable[int] | None = None,
        timeout: float | None = None,
        *,
        display_ranks: Iterable[int] = (0,),
        quiet: bool = False,
        grace: float | None = None,
        kernel: dict[str, Any] | None = None,
    ) -> None:
        """Run a script written for torchrun on the ranks, unmodified (what ``%mnb run`` does)::

            pool.run_script("train.py", ["--lr", "3e-4"])    # as torchrun --nproc-per-node N train.py --lr 3e-4

        The ranks give it ``__name__ == "__main__"``, ``sys.argv``, torchrun's environment, and
        adopt its ``init_process_group``, ``set_device`` and Megatron parallel-state calls
        (``mnb.worker.script``, ``mnb.megatron.adopt``); its globals stay for later cells and the
        pool's layout is restored after it.  Output, errors, timeouts and interrupts are a cell's.
        ``kernel``: the notebook's cwd and environment changes, for the run
        (``mnb.controller.kernel_context``, ``mnb.worker.sandbox``).  ``args``: a list of strings (a
        command line's words: ``shlex.split(text)``); ``timeout`` and ``grace`` are checked as :meth:`run`'s.
        """
        if isinstance(args, (str, bytes)):
            raise TypeError(f"args is a list of the script's arguments, e.g. ['--lr', '3e-4'], not one "
                            f"{type(args).__name__} ({args!r}); shlex.split(text) splits a command line")
        check_timing(timeout, grace)
        script = Path(path).expanduser()
        if not script.is_file():
            raise FileNotFoundError(f"no script {str(script)!r}{cwd_note(script)}")
        targets = self._prepare_request(ranks)
        header: dict[str, Any] = {
            "code": "", "script": {"path": str(script.resolve()), "args": [str(a) for a in args]},
            "ranks": targets, "display_ranks": list(display_ranks), "want_value": False, "show_result": False,
        }
        if kernel:
            header["kernel"] = kernel
        outcome = self._exchange(self._seal("execute", header), targets, timeout=timeout, stream=not quiet,
                                 grace=grace)
        for rank, reply in outcome.replies.items():  # label by the pool's coordinates, not the script's
            reply.header["coords"] = self.ranks[rank].coords
        errors, _ = self._absorb(outcome)
        self._keep_failure(targets, errors, died=outcome.died)  # %mnb debug: a script's as a cell's
        records = self.last_cell_records
        if not (outcome.died or outcome.unreleased or outcome.cancelled):
            # Every rank is idle (an interrupted script's waiting ranks were released): rebuild the pool's
            # layout (collectives) in a request of its own, so the next cell finds it.
            after = self._exchange(self._seal("execute", {"code": "None", "after_script": True, "want_value": False}),
                                   targets, timeout=self._repair.start_timeout_s, stream=False)
            errors += self._absorb(after)[0]
            self.last_cell_records = records
            if after.died or after.unreleased or after.waiting or after.timed_out:
                outcome = after
        self._raise_for(outcome, targets, errors)

    def _absorb(self, outcome: Outcome) -> tuple[list[RankError], dict[int, Any]]:
        """Coordinates, layout, run records, the profile folder and values of an execute's replies (in
        arrival order)."""
        errors: list[RankError] = []
        values: dict[int, Any] = {}
        profiles: list[str] = []  # the folder the ranks wrote the cell's profile to (the same on each)
        records: list[dict[str, Any]] = []
        last_records: list[dict[str, Any]] = []  # each rank's last training of the cell: mnb.last_run
        for rank, reply in outcome.replies.items():
            info = self.ranks[rank]
            info.coords = reply.get("coords") or info.coords
            payload = reply.payload or {}
            records.extend(payload.get("records") or [])
            last_records.extend((payload.get("records") or [])[-1:])
            if reply.get("profile_dir"):
                profiles.append(reply["profile_dir"])
            if reply.get("payload_error") and reply.get("ok"):
                errors.append(RankError(
                    rank=rank, ename="UnpicklingError", label=info.label(self.layout.as_dict()),
                    evalue=f"the notebook kernel could not rebuild this rank's result: {reply['payload_error']}",
                ))
            elif reply.get("ok"):
                values[rank] = payload.get("value")
            elif reply.get("ename") != "KeyboardInterrupt" or not (outcome.interrupted or rank in outcome.waiting):
                errors.append(self._rank_error(rank, reply))  # not the interrupt mnb itself sent
        self.last_cell_records = records
        self.last_cell_profile = profiles[0] if profiles else None
        if last_records:  # a cell that trained twice: the second training, not a mix of both
            record_training(sorted(last_records, key=lambda r: r.get("rank", 0)))
        return errors, dict(sorted(values.items()))

    @exclusive
    def push(self, namespace: dict[str, Any], ranks: Iterable[int] | None = None) -> None:
        """Bind names on the ranks: ``pool.push({"lr": 1e-3})``.

        Each name is pickled here first: what the ranks could not rebuild (a lambda,
        a function or class of the notebook, an open file, a lock) raises TypeError
        naming it before any rank is touched.
        """
        encoded = encode_push(namespace)  # raises before any rank is touched
        targets = self._prepare_request(ranks)
        self._raise_errors(self._request("push", targets, {"encoded": True}, payload=encoded, timeout=VALUES_TIMEOUT_S))

    @exclusive
    def pull(self, name: str | list[str], ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """Read a name (or names) from the ranks: ``{rank: value}`` (tensors arrive as numpy).

        Values the kernel cannot rebuild without torch (torch functions, models,
        objects of cell-defined classes) arrive as ``mnb.values.Unportable`` notes
        showing their repr and why; a value that still fails to decode raises one
        CompositeRankError naming the name(s) and rank(s), and the ranks stay idle.
        """
        names = [name] if isinstance(name, str) else list(name)
        targets = self._prepare_request(ranks)
        replies = self._request("pull", targets, {"names": names}, timeout=VALUES_TIMEOUT_S)
        self._raise_errors(replies)
        pulled: dict[int, dict[str, Any]] = {}
        errors, failed = [], []
        for rank, reply in sorted(replies.items()):
            try:
                pulled[rank] = decode_values(reply.payload or {})
            except ValueDecodeError as exc:
                failed += [n for n in exc.problems if n not in failed]
                errors.append(RankError(rank=rank, ename="ValueDecodeError", evalue=str(exc),
                                        label=self.ranks[rank].label(self.layout.as_dict())))
        if errors:
            raise CompositeRankError(
                errors, cell_ranks=sorted(replies),
                headline=(f"pull: the notebook kernel cannot rebuild {', '.join(map(repr, failed))} from "
                          f"rank(s) {[e.rank for e in errors]}; the values stay on the ranks (pull plain data "
                          "instead, e.g. x.tolist() or str(x) computed in a %%megatron cell)"),
            )
        if isinstance(name, str):
            return {rank: values[name] for rank, values in pulled.items()}
        return pulled

    # ------------------------------------------------------------ internals
    def _prepare_request(self, ranks: Iterable[int] | None) -> list[int]:
        """Make the pool ready for a request on ``ranks`` (all when None) and return them, checked.

        Acts before it answers: waits for a restart under way; replaces ranks that died while the pool
        was idle (and prints that it did); drops what arrived between requests (:meth:`_drain`);
        replaces the targets still busy with a request that was never answered (raising
        :class:`PoolError`).  A rank number out of range is a :class:`RequestRefused`.
        """
        self._repair.wait(self._gate.latch())
        line = self._repair.replace_if_dead(self.layout)
        if line:  # a rank died while the pool was idle: this request runs on the new ranks
            print(f"mnb: {line}", flush=True)
            self._repair.wait(self._gate.latch())
        try:
            targets = sorted(self.ranks) if ranks is None else check_ranks(ranks, self.world_size)
        except ValueError as exc:
            raise RequestRefused(str(exc)) from None
        self._drain()
        busy = [r for r in targets if self.ranks[r].state == "busy"]
        if busy:  # a request that was never answered: replace the ranks rather than refuse forever
            raise PoolError(self._repair.replace(f"rank(s) {busy} never answered an earlier request", self.layout))
        return targets

    def _drain(self) -> None:
        """Handle messages that arrived between requests (late output of ended cells is dropped).

        Only a request (which holds the gate) drains: the inbox is the request's alone.
        """
        transport = self._repair.transport
        if transport is None:
            return
        while True:
            try:
                message = transport.inbox.get_nowait()
            except queue.Empty:
                break
            self._handle_stray(message)
        if self._stray_lines:
            log.info("dropped %d late output line(s) of earlier cells", self._stray_lines)
            self._stray_lines = 0

    def _handle_stray(self, message: Message) -> None:
        """A message of a request that already ended: never replayed into the current cell."""
        info = self.ranks.get(message.get("rank"))
        if info is None:
            return
        if message.type == "reply" and info.state == "busy" and message.id == info.request_id:
            info.state, info.request_id = "idle", None
        elif message.type == "input_request" and (transport := self._repair.transport) is not None:  # its cell ended: do not hang
            transport.send(message.get("rank"), Message("input_reply", id=message.id, header={
                "error": "interrupt", "text": "the cell that asked has ended"}))
        elif message.type == "stream":
            self._stray_lines += message["text"].count("\n") or 1

    def _seal(self, kind: str, header: dict[str, Any], payload: Any = None) -> Sealed:
        """The request's message, signed once for the generation :meth:`_prepare_request` made ready and, for
        a cell, numbered (the same ``<cell-N>`` on every rank).  A message over the protocol's limit raises
        :class:`~mnb.errors.MessageTooLarge` here, before the request changes any state or touches a rank
        (its number is not spent)."""
        number = self._cells_sent + 1
        if kind == "execute":
            header = {**header, "number": number}
        message = Message(kind, header=header, payload=payload)
        generation = self._repair.generation
        frames = generation.transport.seal(message)
        if kind == "execute":
            self._cells_sent = number
        return Sealed(message, frames, generation)

    def _exchange(self, sealed: Sealed, targets: list[int], *, timeout: float | None = None, stream: bool = True,
                  grace: float | None = None) -> Outcome:
        """Send one sealed request to ``targets`` and wait for its outcome (no error raised here).

        The ranks that replied are idle again whatever ended the wait; the others stay
        busy (still running it: the next request replaces them rather than queue behind).
        """
        return sealed.generation.exchange(
            sealed.message, targets, self.layout.as_dict(), self._gate.latch(),
            timeout_s=timeout if timeout is not None else self.cell_timeout_s,
            grace_s=self.grace_s if grace is None else grace, stream=stream,
            event_handlers=self.event_handlers, on_stray=self._handle_stray, frames=sealed.frames,
        )

    def _request(self, kind: str, targets: list[int], header: dict[str, Any], *, payload: Any = None,
                 timeout: float | None = None, stream: bool = True) -> dict[int, Message]:
        """A request whose error replies the caller handles; deaths, hangs and interrupts raise here
        (:class:`~mnb.errors.MessageTooLarge` before anything is sent)."""
        outcome = self._exchange(self._seal(kind, header, payload), targets, timeout=timeout, stream=stream)
        self._raise_for(outcome, targets, [])
        return dict(sorted(outcome.replies.items()))

    def _raise_for(self, outcome: Outcome, targets: list[int], errors: list[RankError],
                   code: str | None = None, unlaid: list[int] | None = None) -> None:
        """Turn an outcome into the one error the notebook shows, after the repair part acted on it.
        ``code``: the cell's, so that a crash report can quote the line a rank died on; ``unlaid``:
        ranks that did not take the cell's layout (``_confirm_layout``)."""
        if outcome.cancelled:
            raise PoolError(outcome.cancelled)
        if outcome.died:  # the report first: replacing the processes empties what it reads
            lines, first, deaths = self._death_report(code)
            lines.append(self._repair.after(outcome, self.layout, died=first))
            if self.spec.nnodes > 1:
                lines.append(f"torchrun log: {self.spec.log_file}")
            raise RankDiedError("\n".join(lines), deaths)
        note = self._repair.after(outcome, self.layout, unlaid=unlaid)
        if outcome.error is not None:
            raise outcome.error
        if outcome.interrupted:
            raise interrupted(reports.interrupt_line(outcome, targets, self.labels()) + (f"\n{note}" if note else ""))
        if outcome.timed_out:
            raise CellTimeoutError(reports.timeout_text(outcome, targets, self.labels(), note), outcome.stacks)
        if errors or outcome.waiting:
            raise reports.failure_error(errors, outcome, targets, self.labels(), note)

    def labels(self) -> dict[int, str]:
        """Each rank's label in the current layout: ``{1: "r1 tp0 pp0 dp1"}``."""
        layout = self.layout.as_dict()
        return {rank: info.label(layout) for rank, info in self.ranks.items()}

    def _rank_error(self, rank: int, reply: Message) -> RankError:
        return RankError(rank=rank, ename=reply.get("ename", "Error"), evalue=reply.get("evalue", ""),
                         traceback=reply.get("traceback", ""), label=self.ranks[rank].label(self.layout.as_dict()))

    def _death_report(self, code: str | None = None) -> tuple[list[str], list[int], dict[int, str]]:
        """How each rank ended (the first failure first) and, for a rank a signal killed, the Python line
        it crashed on (``code``: the cell's, to quote that line); with the ranks that failed first and
        ``{rank: how it ended}``.  Waits for torchrun's record of the failure (``DEATH_REPORT_WAIT_S``)."""
        generation = self._repair.generation
        deaths = generation.launcher.deaths(DEATH_REPORT_WAIT_S)
        now, beats = time.monotonic(), generation.transport.last_heartbeat
        for rank, info in generation.ranks.items():
            if not info.local and now - beats.get(rank, now) > REMOTE_RANK_SILENCE_S:
                deaths.setdefault(rank, f"no heartbeat for {REMOTE_RANK_SILENCE_S:.0f} s (host {info.host})")
        deaths = deaths or {r: "stopped with torchrun" for r in generation.ranks}
        words = dict(generation.transport.last_words)  # a rank that said why it exits (its late start failed)
        for rank, message in words.items():
            deaths[rank] = f"{deaths.get(rank, 'exited')}; {reports.last_words(message)}"
        lines, first = reports.death_lines(deaths, self.labels())
        lines += reports.last_words_lines(words)
        for rank in first:
            if "killed by signal" in deaths.get(rank, ""):
                path, found = generation.launcher.fault_report(rank)
                crash = reports.fault_lines(found, code)
                if crash:
                    lines += [f"rank {rank}'s Python stack at the crash (faulthandler; every thread in {path}):", *crash]
        return lines, first, deaths

    def _raise_errors(self, replies: dict[int, Message]) -> None:
        errors = [self._rank_error(r, m) for r, m in sorted(replies.items()) if not m.get("ok")]
        if errors:
            raise CompositeRankError(errors, cell_ranks=sorted(replies))

