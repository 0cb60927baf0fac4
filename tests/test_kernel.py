"""A real Jupyter kernel: the "Python 3 (mnb)" kernel has mnb from the start; a sweep renders once.

Kernel -> Interrupt reaching the ranks, and a kernel's shutdown leaving no worker, are
tests/controller/test_recovery.py's (its print-loop test and its module kernel's teardown)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.slow


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


@pytest.fixture(scope="module")
def mnb_kernel(tmp_path_factory):
    """The "Python 3 (mnb)" kernel, installed the documented way into a temporary prefix; one for the
    module (its first test reads it as it starts, the sweep test then starts a pool in it)."""
    prefix = tmp_path_factory.mktemp("kernelspec")
    subprocess.run([sys.executable, "-m", "mnb.kernelspec", "install", "--prefix", str(prefix)], check=True,
                   capture_output=True)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
        from jupyter_client.kernelspec import KernelSpecManager

        spec = KernelSpecManager().get_kernel_spec("mnb")
        assert spec.display_name == "Python 3 (mnb)" and str(prefix) in spec.resource_dir
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
