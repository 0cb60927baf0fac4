"""A real Jupyter kernel driven as JupyterLab drives it: execute requests, Kernel -> Interrupt, kill.

Tests read what a notebook would show: the iopub stream text, each message's
arrival time, and the error a cell ended with (its ``traceback`` is exactly
what the notebook renders).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.manager import start_new_kernel


@dataclass
class CellResult:
    text: str = ""
    errors: list[dict] = field(default_factory=list)
    streams: list[tuple[float, str]] = field(default_factory=list)
    """(wall-clock arrival time, text) of every stream message of the cell (ranks share the clock)."""
    started: float = 0.0
    ended: float = 0.0

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

    def send(self, code: str) -> str:
        # stop_on_error=False: a request sent right after an interrupted cell's error must
        # not be aborted by the kernel's "stop on error" window.
        msg_id = self.client.execute(code, stop_on_error=False)
        self._sent[msg_id] = CellResult(started=time.time())
        return msg_id

    def wait(self, msg_id: str, timeout: float = 300) -> CellResult:
        result = self._sent[msg_id]
        deadline = time.monotonic() + timeout
        while True:
            msg = self.client.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
            parent = msg["parent_header"].get("msg_id")
            if parent not in self._sent:
                continue
            into = self._sent[parent]
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                into.text += content["text"]
                into.streams.append((time.time(), content["text"]))
            elif kind == "error":
                into.errors.append(content)
            elif kind == "status" and content["execution_state"] == "idle":
                into.ended = time.time()
                if parent == msg_id:
                    return result

    def execute(self, code: str, timeout: float = 300) -> CellResult:
        return self.wait(self.send(code), timeout)

    def ok(self, code: str, timeout: float = 300) -> str:
        """Run a cell that must succeed; its printed text."""
        result = self.execute(code, timeout)
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
