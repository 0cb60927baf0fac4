"""Answering a rank's ``input()``/``getpass``/pdb prompt with the notebook's own stdin.

A rank's cell that asks for a line sends an ``input_request`` (``mnb/worker/stdin.py``).
While the collector waits for the request it hands each one to :class:`StdinServer`,
which asks the kernel's ``input()``/``getpass.getpass()`` (ipykernel turns them into
Jupyter's ``input_request`` on the stdin channel, as for a local ``input()``) with the
prompt labelled by the rank, ``[r1 tp1 pp0 dp0] (Pdb) ``, and sends the line back to that
rank only.  Other ranks keep running meanwhile (until they wait for it in a collective).

Order: one rank at a time, lowest rank first.  A rank in a conversation (a pdb session:
one prompt after another) keeps the stdin until it finished the cell or has not asked again
for :data:`HOLD_S`; a new conversation starts once its first request has waited
:data:`GATHER_S`, so ranks stopping at one ``breakpoint()`` together are served in rank order.

Answers that are not a line: a front-end without stdin (nbclient, ``allow_stdin=False``:
ipykernel's ``StdinNotImplementedError``; outside a kernel, an unreadable stdin) answers
``no-stdin`` at once, which the rank raises as ``NoStdinError``; Ctrl-D (ipykernel's
``EOFError``) answers ``eof``; Jupyter's interrupt while the kernel waits for the user ends
the request like any interrupt.  Torch-free.
"""

from __future__ import annotations

import builtins
import contextlib
import getpass
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

from mnb.protocol import Message

HOLD_S = 1.0
"""How long a rank that was just answered keeps the stdin while it has not asked again."""
GATHER_S = 0.5
"""How long the first request of a new conversation waits for lower ranks' requests."""

Ask = Callable[[str, bool], str]
"""(prompt, password) -> the line the user typed (raises as the kernel's input() does)."""


def ask_kernel(prompt: str, password: bool) -> str:
    """The kernel's own ``input()`` / ``getpass.getpass()``, with Jupyter's interrupt raised while it waits."""
    with _interrupt_raises():
        return getpass.getpass(prompt) if password else builtins.input(prompt)


@contextlib.contextmanager
def _interrupt_raises() -> Iterator[None]:
    """The request's interrupt latch counts SIGINT; the kernel's input() must see it as KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class StdinServer:
    """The input requests of one request's ranks, served one rank at a time."""

    def __init__(self, transport: Any, request_id: str, labels: dict[int, str], ask: Ask = ask_kernel,
                 write: Callable[[str], None] | None = None):
        self.transport = transport
        self.request_id = request_id
        self.labels = labels
        self.ask = ask
        self.write = write or (lambda text: (sys.stderr.write(text), sys.stderr.flush()))
        self.pending: dict[int, list[tuple[float, Message]]] = {}
        self.current: int | None = None
        self.answered_at = 0.0
        self.closed = ""
        """Why no more requests are answered with a line (the cell is ending); set by :meth:`close`."""
        self.no_stdin = ""
        """The front-end's refusal, once seen: later requests of the cell get it without asking again."""
        self.served: list[int] = []
        """The ranks a conversation was started with, in order (each once per conversation)."""
        self.running = set(labels)
        """The request's ranks that have not replied yet."""

    def add(self, message: Message) -> None:
        rank = message.get("rank")
        if self.closed or message.get("cell") != self.request_id or rank not in self.labels:
            self._answer(message, error="interrupt", text=self.closed or "the cell that asked has ended")
            return
        self.pending.setdefault(rank, []).append((time.monotonic(), message))

    def finished(self, rank: int) -> None:
        """``rank`` replied: its requests are over (a conversation with it ends)."""
        self.running.discard(rank)
        if self.current == rank:
            self.current = None

    def next_rank(self) -> int | None:
        """The rank to serve now, or None (nothing asked, or the current conversation holds the stdin)."""
        now = time.monotonic()
        if self.current is not None:
            if self.pending.get(self.current):
                return self.current
            if now - self.answered_at < HOLD_S:
                return None
            self.current = None
        waiting = sorted(rank for rank, queue in self.pending.items() if queue)
        if not waiting or now - min(self.pending[r][0][0] for r in waiting) < GATHER_S:
            return None
        return waiting[0]

    def serve(self) -> bool:
        """Answer one request if one is due; True when the user interrupted (the request must end)."""
        rank = self.next_rank()
        if rank is None:
            return False
        _, message = self.pending[rank].pop(0)
        label = self.labels.get(rank, f"r{rank}")
        if rank != self.current:
            self.current = rank
            self.served.append(rank)
            others = sorted(self.running - {rank})
            if others and not self.no_stdin:
                self.write(f"mnb: [{label}] waits for input; rank(s) {others} keep running until they wait "
                           "for it (answers go to this rank only)\n")
        prompt = message.get("prompt") or ""
        if self.no_stdin:
            self._answer(message, error="no-stdin", text=self.no_stdin)
            return False
        try:
            value = self.ask(f"[{label}] {prompt}", bool(message.get("password")))
        except KeyboardInterrupt:
            self._answer(message, error="interrupt", text="interrupted from the notebook")
            return True
        except EOFError:
            self._answer(message, error="eof", text="input ended (Ctrl-D in the notebook)")
        except Exception as exc:  # StdinNotImplementedError (nbclient), or no readable stdin outside a kernel
            self.no_stdin = (
                f"input() on rank {rank} asked the notebook for a line, but this front-end cannot answer "
                f"({type(exc).__name__}: {exc}); run the cell in JupyterLab or Notebook (they answer "
                "input requests), or pass the value instead (mnb.pool().push({...}))"
            )
            self._answer(message, error="no-stdin", text=self.no_stdin)
        else:
            self._answer(message, value=value)
        self.answered_at = time.monotonic()
        return False

    def close(self, reason: str) -> None:
        """The cell is ending: every waiting request (and any later one) is answered with an interrupt."""
        self.closed = reason
        for queue in self.pending.values():
            for _, message in queue:
                self._answer(message, error="interrupt", text=reason)
        self.pending.clear()

    def _answer(self, request: Message, **header: Any) -> None:
        self.transport.send(request.get("rank"), Message("input_reply", id=request.id, header=header))
