"""A real Jupyter kernel driven as JupyterLab drives it: execute requests, Kernel -> Interrupt, kill.

Tests read what a notebook would show: the iopub stream text, each message's
arrival time, and the error a cell ended with (its ``traceback`` is exactly
what the notebook renders).  ``execute(code, answers=[...])`` sends the cell with
``allow_stdin=True`` and answers each ``input_request`` on the stdin channel with the
next answer, as JupyterLab's input box does (the prompts asked are in ``CellResult.prompts``);
without ``answers`` the cell runs with ``allow_stdin=False``, as under nbclient.
"""

from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.manager import start_new_kernel


@dataclass(frozen=True)
class Late:
    """An answer typed ``after_s`` seconds after the input box opened."""

    text: str
    after_s: float


@dataclass
class CellResult:
    text: str = ""
    errors: list[dict] = field(default_factory=list)
    streams: list[tuple[float, str]] = field(default_factory=list)
    """(wall-clock arrival time, text) of every stream message of the cell (ranks share the clock)."""
    started: float = 0.0
    ended: float = 0.0
    prompts: list[tuple[str, bool]] = field(default_factory=list)
    """(prompt, password) of each input_request the kernel sent, in order."""
    answers: list[str | None] | None = None
    """What is typed into the next input boxes (``allow_stdin=True``; an entry None: Kernel -> Interrupt
    instead of an answer); None: no stdin."""

    @property
    def error(self) -> dict | None:
        return self.errors[0] if self.errors else None

    def first_time(self, needle: str) -> float | None:
        """When the first stream message containing ``needle`` arrived."""
        return next((t for t, text in self.streams if needle in text), None)


class Kernel:
    def __init__(self) -> None:
        self.manager, self.client = start_new_kernel(kernel_name="python3")
        self._sent: dict[str, CellResult] = {}

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def send(self, code: str, answers: list[str | None] | None = None) -> str:
        # stop_on_error=False: a request sent right after an interrupted cell's error must
        # not be aborted by the kernel's "stop on error" window.
        msg_id = self.client.execute(code, stop_on_error=False, allow_stdin=answers is not None)
        self._sent[msg_id] = CellResult(started=time.time(), answers=None if answers is None else list(answers))
        return msg_id

    def _answer_stdin(self) -> None:
        """Answer the kernel's input_request with the cell's next answer (Ctrl-D once they run out)."""
        while self.client.stdin_channel.msg_ready():
            msg = self.client.get_stdin_msg(timeout=1)
            if msg["msg_type"] != "input_request":
                continue
            into = self._sent.get(msg["parent_header"].get("msg_id"))
            if into is None:
                continue
            into.prompts.append((msg["content"]["prompt"], bool(msg["content"].get("password"))))
            answer = into.answers.pop(0) if into.answers else "\x04"
            if answer is None:  # Kernel -> Interrupt while the input box waits
                self.interrupt()
            elif isinstance(answer, Late):  # a user who thinks before typing
                time.sleep(answer.after_s)
                self.client.input(answer.text)
            else:
                self.client.input(answer)

    def wait(self, msg_id: str, timeout: float = 300) -> CellResult:
        result = self._sent[msg_id]
        deadline = time.monotonic() + timeout
        while True:
            if result.answers is not None:
                self._answer_stdin()
                try:
                    msg = self.client.get_iopub_msg(timeout=0.05)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise
                    continue
            else:
                msg = self.client.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
            if self._record(msg) == msg_id:
                return result

    def _record(self, msg: dict) -> str | None:
        """Add one iopub message to its cell's result; the cell's msg_id when it says the kernel went idle."""
        parent = msg["parent_header"].get("msg_id")
        if parent not in self._sent:
            return None
        into = self._sent[parent]
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            into.text += content["text"]
            into.streams.append((time.time(), content["text"]))
        elif kind == "error":
            into.errors.append(content)
        elif kind == "status" and content["execution_state"] == "idle":
            into.ended = time.time()
            return parent
        return None

    def wait_for_text(self, msg_id: str, needle: str, timeout: float = 300) -> None:
        """Read the kernel's messages until the running cell ``msg_id`` printed ``needle`` (an event to
        wait on instead of a sleep); what it printed stays in its result for :meth:`wait`."""
        result = self._sent[msg_id]
        deadline = time.monotonic() + timeout
        while needle not in result.text:
            assert not result.ended, f"the cell ended without printing {needle!r}: {result.text[-2000:]}"
            self._record(self.client.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic())))

    def execute(self, code: str, timeout: float = 300, answers: list[str | None] | None = None) -> CellResult:
        return self.wait(self.send(code, answers), timeout)

    def ok(self, code: str, timeout: float = 300, answers: list[str | None] | None = None) -> str:
        """Run a cell that must succeed; its printed text."""
        result = self.execute(code, timeout, answers)
        assert not result.errors, (result.text, [e["traceback"] for e in result.errors])
        return result.text

    def value(self, expression: str) -> Any:
        """A JSON-able value computed in the kernel."""
        return json.loads(self.ok(f"import json as _json\nprint(_json.dumps({expression}))").strip().splitlines()[-1])

    def interrupt(self) -> None:
        """What Kernel -> Interrupt does: SIGINT to the kernel's process group."""
        self.manager.interrupt_kernel()

    def shutdown(self) -> None:
        try:
            self.manager.shutdown_kernel(now=False)
        finally:
            self.client.stop_channels()
