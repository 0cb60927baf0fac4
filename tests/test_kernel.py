"""A real Jupyter kernel: Kernel -> Interrupt reaches the ranks; shutdown leaves no worker."""

from __future__ import annotations

import json
import time

import pytest
from jupyter_client.manager import start_new_kernel

from tests.conftest import alive_pids

pytestmark = pytest.mark.slow


def execute(client, code: str, timeout: float = 180) -> tuple[str, list[dict]]:
    # stop_on_error=False: a request sent right after the interrupted cell's error must
    # not be aborted by the kernel's "stop on error" window.
    msg_id = client.execute(code, stop_on_error=False)
    text, errors = "", []
    while True:
        msg = client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            text += content["text"]
        elif kind == "error":
            errors.append(content)
        elif kind == "status" and content["execution_state"] == "idle":
            return text, errors


def test_interrupt_from_jupyter_and_no_orphans_after_shutdown():
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        execute(client, "%load_ext mnb")
        text, errors = execute(client, "%mnb start -n 2 --device cpu")
        assert not errors and "2 ranks ready" in text, (text, errors)
        pids = json.loads(execute(client, "import json, mnb\nprint(json.dumps(mnb.pool().pids()))")[0])
        msg_id = client.execute("%%megatron\nimport time\nfor _ in range(600):\n    time.sleep(0.05)", stop_on_error=False)
        time.sleep(2.0)
        started = time.monotonic()
        manager.interrupt_kernel()  # what Kernel -> Interrupt does: SIGINT to the kernel's process group
        while True:
            msg = client.get_iopub_msg(timeout=30)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "error":
                assert msg["content"]["ename"] == "KeyboardInterrupt"
                break
        assert time.monotonic() - started < 5
        text, errors = execute(client, "%%megatron\nprint('still here', rank)")
        assert not errors and "still here 0" in text and "still here 1" in text, (text, errors)
    finally:
        manager.shutdown_kernel(now=False)
        client.stop_channels()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and alive_pids(pids):
        time.sleep(0.2)
    assert alive_pids(pids) == []
