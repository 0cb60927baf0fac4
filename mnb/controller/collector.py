"""Waiting for one request's replies while streaming output and watching the ranks.

Every wait is bounded: each 0.1 s the collector checks that local rank
processes live (psutil) and that remote ranks still send heartbeats; past the
cell's timeout it fetches each pending rank's Python stack, interrupts, and
raises :class:`CellTimeoutError`; on Jupyter's interrupt it forwards the
interrupt to the ranks and waits briefly for them to return.
"""

from __future__ import annotations

import queue
import re
import time
from typing import TYPE_CHECKING, Any

from mnb.controller.output import LineFolder, ProgressLine, show_bundle
from mnb.errors import CellTimeoutError, RankDiedError, format_rank_set
from mnb.protocol import Message

if TYPE_CHECKING:
    from mnb.controller.pool import Pool

REMOTE_SILENCE_S = 20.0


class Collector:
    """Waits for one request's replies while streaming output and watching the ranks."""

    def __init__(self, pool: Pool, request_id: str, targets: list[int], timeout_s: float | None, stream: bool):
        self.pool = pool
        self.request_id = request_id
        self.targets = targets
        self.timeout_s = timeout_s
        self.replies: dict[int, Message] = {}
        layout = pool.layout.as_dict()
        labels = {r: pool.ranks[r].label(layout) for r in targets}
        self.folder = LineFolder(targets, labels) if stream else None
        self.progress: ProgressLine | None = None

    def wait(self) -> dict[int, Message]:
        start = time.monotonic()
        try:
            while len(self.replies) < len(self.targets):
                if self.timeout_s is not None and time.monotonic() - start > self.timeout_s:
                    self._on_timeout()
                self._step()
        except KeyboardInterrupt:
            self._on_interrupt()
            raise
        finally:
            if self.folder:
                self.folder.flush()
        return self.replies

    def _step(self, wait_s: float = 0.1) -> None:
        transport = self.pool._transport
        try:
            message = transport.inbox.get(timeout=wait_s)
        except queue.Empty:
            message = None
        if message is not None:
            self._handle(message)
        if self.folder:
            self.folder.poll()
        self._check_alive()

    def _handle(self, message: Message) -> None:
        rank = message.get("rank")
        if message.type == "reply" and message.id == self.request_id:
            self.replies[rank] = message
            self.pool.ranks[rank].state, self.pool.ranks[rank].cell = "idle", None
        elif message.type == "stream":
            if self.folder and rank in self.folder.labels and message.get("cell") == self.request_id:
                self.folder.feed(rank, message["name"], message["text"])
            else:
                self.pool._handle_stray(message)
        elif message.type == "display":
            if self.folder:
                self.folder.flush()
            show_bundle(message.payload or {})
        elif message.type == "event":
            self._on_event(rank, message.get("kind"), message.payload or {})
        else:
            self.pool._handle_stray(message)

    def _on_event(self, rank: int, kind: str, payload: dict[str, Any]) -> None:
        handlers = self.pool.event_handlers
        for handler in handlers:
            handler(rank, kind, payload)
        if kind == "progress" and not handlers:
            self.progress = self.progress or ProgressLine()
            self.progress.update(payload)

    def _check_alive(self) -> None:
        pool, launcher, transport = self.pool, self.pool._launcher, self.pool._transport
        dead = set(launcher.dead_ranks())
        torchrun_gone = launcher.returncode() is not None
        now = time.monotonic()
        silent = {r for r in self.targets if not pool.ranks[r].local
                  and now - transport.last_heartbeat.get(r, now) > REMOTE_SILENCE_S}
        if not dead and not torchrun_gone and not silent:
            return
        # Give torchrun a moment to write its failure summary, then report every death.
        deadline = time.monotonic() + 3.0
        while launcher.returncode() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        failures = launcher.failures()
        dead |= set(launcher.dead_ranks()) | set(failures)
        deaths = {r: failures.get(r, "exited") for r in sorted(dead)}
        if any("SIGTERM" not in why for why in deaths.values()):
            # torchrun SIGTERMs the survivors of a failure: say so, not "killed".
            deaths = {r: why if "SIGTERM" not in why else f"torn down by torchrun after the failure ({why})"
                      for r, why in deaths.items()}
        for r in silent:
            deaths.setdefault(r, f"no heartbeat for {REMOTE_SILENCE_S:.0f} s (host {pool.ranks[r].host})")
        if not deaths and torchrun_gone:
            deaths = {r: "stopped with torchrun" for r in pool.ranks}
        # The rank(s) that failed first, then those torchrun tore down after them.
        ordered = sorted(deaths.items(), key=lambda item: ("torn down" in item[1], item[0]))
        lines = [f"rank {r} ({pool.ranks[r].label(pool.layout.as_dict())}) died: {why}" for r, why in ordered]
        survivors = [r for r in pool.ranks if r not in deaths]
        if self.folder:
            self.folder.flush()
        first = [r for r, why in ordered if "torn down" not in why] or sorted(deaths)
        pool._mark_broken(f"rank(s) {first} died")
        pool._teardown()
        lines.append(
            f"The other ranks {survivors} were torn down; run %mnb restart (or mnb.pool().restart()) "
            f"to start {pool.world_size} fresh ranks. torchrun log: {pool.spec.log_file}"
            if survivors else
            f"Run %mnb restart (or mnb.pool().restart()) to start {pool.world_size} fresh ranks. "
            f"torchrun log: {pool.spec.log_file}"
        )
        raise RankDiedError("\n".join(lines), deaths)

    def _pending(self) -> list[int]:
        return [r for r in self.targets if r not in self.replies]

    def _on_timeout(self) -> None:
        pool = self.pool
        pending = self._pending()
        stacks = {r: m.get("stacks", "") for r, m in pool._ask_io_thread("stacks", pending, 3.0).items()}
        self._interrupt_and_wait(pending, grace_s=2.0)
        still = self._pending()
        finished = [r for r in self.targets if r not in pending]
        layout = pool.layout.as_dict()
        lines = [f"cell timed out after {self.timeout_s:g} s; rank(s) {pending} had not finished."]
        for rank in pending:
            where = last_frame(stacks.get(rank, "")) or "(no stack: the rank did not answer)"
            lines.append(f"  [{pool.ranks[rank].label(layout)}] at {where}")
        if finished:
            lines.append(f"  rank(s) {finished} had finished (did they skip a collective the others wait in?)")
        grouped: dict[str, list[int]] = {}
        for rank, text in stacks.items():
            grouped.setdefault(text, []).append(rank)
        for text, members in grouped.items():
            lines.append(f"\nPython stack of [{format_rank_set(members)}]:")
            lines.append(text.rstrip())
        if still:
            for rank in still:
                info = pool.ranks[rank]
                info.state, info.stuck_in = "stuck", last_frame(stacks.get(rank, "")) or "unknown"
            lines.append(
                f"\nRank(s) {still} did not respond to an interrupt (blocked in C code or a collective). "
                "Run %mnb restart to recover; other cells on these ranks are refused until then."
            )
        else:
            lines.append("\nAll ranks were interrupted; the pool is usable.")
        raise CellTimeoutError("\n".join(lines), stacks)

    def _on_interrupt(self) -> None:
        pending = self._pending()
        self._interrupt_and_wait(pending, grace_s=3.0)
        still = self._pending()
        if still:
            stacks = self.pool._ask_io_thread("stacks", still, 2.0)
            for rank in still:
                info = self.pool.ranks[rank]
                info.state, info.stuck_in = "stuck", last_frame(stacks.get(rank).get("stacks", "")) if rank in stacks else "unknown"
            print(f"mnb: rank(s) {still} did not stop on interrupt (stuck at "
                  f"{', '.join(self.pool.ranks[r].stuck_in for r in still)}); run %mnb restart to recover.")
        elif pending:
            print(f"mnb: interrupted rank(s) {pending}; the pool is usable.")

    def _interrupt_and_wait(self, pending: list[int], grace_s: float) -> None:
        if not pending:
            return
        message = Message("interrupt", header={})
        for rank in pending:
            self.pool._transport.send(rank, message)
        deadline = time.monotonic() + grace_s
        while self._pending() and time.monotonic() < deadline:
            try:
                self._step(wait_s=0.05)
            except KeyboardInterrupt:
                continue


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def last_frame(stack_text: str) -> str:
    """Where a stack stands: the innermost cell line, then the innermost frame.

    e.g. ``cell line 3 `dist.all_reduce(x)` -> distributed_c10d.py:3252 in all_reduce``.
    """
    frames: list[tuple[str, str, str, str]] = []
    lines = stack_text.splitlines()
    for index, line in enumerate(lines):
        match = _FRAME.match(line)
        if match:
            code = lines[index + 1].strip() if index + 1 < len(lines) and not _FRAME.match(lines[index + 1]) else ""
            frames.append((match["file"], match["line"], match["func"], code))
    if not frames:
        return ""
    cell = [f for f in frames if f[0].startswith("<cell-")]
    inner = frames[-1]
    where = f"{inner[0].rsplit('/', 1)[-1]}:{inner[1]} in {inner[2]}"
    if cell and cell[-1] is not inner:
        return f"cell line {cell[-1][1]} `{cell[-1][3]}` -> {where}"
    if cell:
        return f"cell line {inner[1]} `{inner[3]}`"
    return where + (f": {inner[3]}" if inner[3] else "")
