"""A real Jupyter kernel: Kernel -> Interrupt reaches the ranks; shutdown leaves no worker;
the "Python 3 (mnb)" kernel has mnb from the start; a sweep renders once."""

from __future__ import annotations

import json
import subprocess
import sys
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
        msg_id = client.execute("%%megatron\nimport time\ndone = -1\nprint('looping', flush=True)\n"
                                "for done in range(600):\n    time.sleep(0.05)", stop_on_error=False)
        while True:  # the ranks run the loop: their line reached the notebook
            msg = client.get_iopub_msg(timeout=120)
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream"
                    and "looping" in msg["content"]["text"]):
                break
        manager.interrupt_kernel()  # what Kernel -> Interrupt does: SIGINT to the kernel's process group
        while True:
            msg = client.get_iopub_msg(timeout=30)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "error":
                assert msg["content"]["ename"] == "KeyboardInterrupt"
                break
        text, errors = execute(client, "%%megatron\nprint('still here', rank, 'stopped early:', done < 599)")
        assert not errors, errors  # the same ranks, their names kept; both loops cut short by the interrupt
        assert "still here 0 stopped early: True" in text and "still here 1 stopped early: True" in text, text
    finally:
        manager.shutdown_kernel(now=False)
        client.stop_channels()
    deadline = time.monotonic() + 60  # a few seconds by design; a loaded 2-core machine takes longer
    while time.monotonic() < deadline and alive_pids(pids):
        time.sleep(0.2)
    assert alive_pids(pids) == []


def messages(client, code: str, timeout: float = 300) -> list[dict]:
    """Every iopub message of one cell, in order, until the kernel is idle again."""
    msg_id = client.execute(code, stop_on_error=False)
    found = []
    while True:
        msg = client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        found.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return found


def stream_text(found: list[dict]) -> str:
    return "".join(m["content"]["text"] for m in found if m["msg_type"] == "stream")


def errors_of(found: list[dict]) -> list[dict]:
    return [m["content"] for m in found if m["msg_type"] == "error"]


@pytest.fixture
def mnb_kernel(tmp_path, monkeypatch):
    """The "Python 3 (mnb)" kernel, installed the documented way into a temporary prefix."""
    subprocess.run([sys.executable, "-m", "mnb.kernelspec", "install", "--prefix", str(tmp_path)], check=True,
                   capture_output=True)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("mnb")
    assert spec.display_name == "Python 3 (mnb)" and str(tmp_path) in spec.resource_dir
    manager, client = start_new_kernel(kernel_name="mnb")
    try:
        yield client
    finally:
        manager.shutdown_kernel(now=False)
        client.stop_channels()


def test_mnb_kernel_has_mnb_bound_and_load_ext_is_silent(mnb_kernel):
    found = messages(mnb_kernel, "print(mnb.__name__, mnb.last_run, 'torch' in __import__('sys').modules)")
    assert not errors_of(found) and stream_text(found) == "mnb None False\n", found
    found = messages(mnb_kernel, "%load_ext mnb")  # the first cell of every tutorial notebook
    assert not errors_of(found) and stream_text(found) == "", found
    assert not [m for m in found if m["msg_type"] in ("display_data", "execute_result")], found
    # The magics work from the start, help included: %mnb start? is the start help, not "Object `start` not found".
    text = stream_text(messages(mnb_kernel, "%mnb start?"))
    assert "--device" in text and "--verbose" in text and "examples:" in text and "not found" not in text, text
    text = stream_text(messages(mnb_kernel, "%%megatron --help\nx = 1"))
    assert "--tp" in text and "runs under exactly that layout" in " ".join(text.split()), text


def test_a_sweep_renders_once_in_a_notebook(mnb_kernel):
    client = mnb_kernel
    text = stream_text(messages(client, "%mnb start -n 2 --device cpu"))
    assert "2 ranks ready" in text, text
    try:
        sweep = "mnb.sweep({'tp': [1, 2]}, steps=1, model='tiny', global_batch_size=4)"
        found = messages(client, sweep)
        assert not errors_of(found), errors_of(found)
        shown = [m for m in found if m["msg_type"] in ("display_data", "update_display_data", "execute_result")]
        results = [m for m in found if m["msg_type"] == "execute_result"]
        assert not results, "the returned value rendered a second copy of the sweep"
        html = [m for m in shown if "mnb-sweep" in m["content"]["data"].get("text/html", "")]
        assert len(html) == 1 and html[0]["msg_type"] == "update_display_data", [m["msg_type"] for m in shown]
        assert "2 of 2 layouts ran" in html[0]["content"]["data"]["text/plain"]
        live = [m for m in shown if m["msg_type"] == "display_data"]
        assert len(live) == 1 and live[0]["content"]["transient"]["display_id"] == \
            html[0]["content"]["transient"]["display_id"]  # the live view became the result, in place
        # The value itself still renders when asked for again, in a later cell.
        found = messages(client, "r = " + sweep.replace("tp': [1, 2]", "tp': [2]"))
        assert not [m for m in found if m["msg_type"] == "execute_result"]
        later = [m for m in messages(client, "r") if m["msg_type"] in ("display_data", "execute_result")]
        assert len(later) == 1 and "mnb-sweep" in later[0]["content"]["data"]["text/html"], later
    finally:
        messages(client, "%mnb stop")
