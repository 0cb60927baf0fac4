"""A real JupyterLab server and a real headless Chromium for the browser tests.

``scripts/setup.sh`` installs what they need: Debian's ``chromium`` through apt-get
and the ``playwright`` Python package through pip (never ``playwright install``: the
browser is the system's).  A test installs nothing itself: without them it is
skipped, with the reason and the command that installs them.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.ports import unclaimed_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


SETUP = "bash scripts/setup.sh --for tests"


def ensure_chromium() -> str:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing; {SETUP} installs Debian's chromium")
    return CHROMIUM


def ensure_playwright():
    try:
        import playwright.sync_api
    except ImportError:
        pytest.skip(f"the playwright package is missing; {SETUP} installs it")
    return playwright.sync_api


class Lab:
    """A JupyterLab server on 127.0.0.1 with a token, serving ``root``."""

    def __init__(self, root: Path, port: int, token: str, proc: subprocess.Popen, log: Path):
        self.root, self.port, self.token, self.proc, self.log = root, port, token, proc, log

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}"

    def api(self, path: str):
        with urllib.request.urlopen(self.url(f"api/{path}"), timeout=5) as reply:
            return json.loads(reply.read())


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab-root")
    home = tmp_path_factory.mktemp("lab-home")
    settings = home / "settings"
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    # No news pop-up over the notebook; no workspace state from earlier sessions.
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    port, token = unclaimed_port(), secrets.token_hex(16)
    log = home / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.news_url=None", "--LabApp.check_for_updates_class="
           "jupyterlab.handlers.announcements.NeverCheckForUpdate"]
    if os.geteuid() == 0:  # containers and CI runners
        cmd.append("--allow-root")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root,
                                start_new_session=True)
    server = Lab(root, port, token, proc, log)
    deadline = time.monotonic() + 120
    while True:
        try:
            server.api("status")
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"JupyterLab did not start; log:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
    yield server
    try:
        for kernel in server.api("kernels"):
            request = urllib.request.Request(server.url(f"api/kernels/{kernel['id']}"), method="DELETE")
            urllib.request.urlopen(request, timeout=10).close()
    except OSError:
        pass
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """Where screenshots go (gitignored)."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module")
def browser_page(lab, tmp_path_factory):
    chromium = ensure_chromium()
    sync_api = ensure_playwright()
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1500, "height": 1100},
        )
        context.set_default_timeout(60_000)
        page = context.new_page()
        try:
            yield page
        finally:
            context.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Expose each phase's report on the test item (used to keep screenshots of failures)."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
