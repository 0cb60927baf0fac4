"""The explorer in a real JupyterLab, in a real (headless) Chromium.

Starts JupyterLab on 127.0.0.1 (free port, token, --no-browser, a temporary
root), opens a notebook that shows ``mnb.explorer(...)``, moves the tp slider
with the keyboard and checks that the memory label and the memory figure
changed; then reloads the page and checks that the widget comes back from the
kernel with the same state.  A second notebook starts a 2-rank CPU pool,
presses "Run on pool", runs another cell while the ranks train (the kernel is
not blocked) and waits for the measured numbers.  Screenshots land in
artifacts/ (gitignored).

    python -m pytest tests/browser -q
"""

from __future__ import annotations

import time

import nbformat
import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ACTIVE = ".jp-NotebookPanel:not(.lm-mod-hidden)"
"""The notebook in the current tab (other open notebooks stay in the DOM, hidden)."""
IDLE = f"{ACTIVE} .jp-Notebook-ExecutionIndicator[data-status='idle']"
LONG_MS = 120_000


def write_notebook(path, sources: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def open_notebook(page, lab, name: str) -> None:
    page.goto(lab.url(f"lab/tree/{name}") + "&reset")  # reset: no tabs restored from earlier tests
    page.wait_for_selector(f"{ACTIVE} .jp-Cell", timeout=LONG_MS)
    page.wait_for_selector(IDLE, timeout=LONG_MS)
    # The kernel's session is connected once the status bar names it and says Idle.
    page.wait_for_function(
        "() => /\\|\\s*Idle/.test(document.querySelector('.jp-StatusBar-Widget, #jp-main-statusbar')?.innerText || '')",
        timeout=LONG_MS,
    )


def run_cell(page, index: int, attempts: int = 3) -> None:
    """Run cell ``index`` with Shift+Enter, again if the kernel was not listening yet.

    A cell has run (or is running) once its prompt shows a number or ``*``.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    cell = page.locator(f"{ACTIVE} .jp-Cell").nth(index)
    for attempt in range(attempts):
        cell.locator(".jp-InputPrompt").click()
        page.keyboard.press("Escape")
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function(
                "([scope, i]) => /\\[(\\d+|\\*)\\]/.test(document.querySelectorAll(scope + ' .jp-Cell')[i]"
                ".querySelector('.jp-InputPrompt').innerText)",
                arg=[ACTIVE, index], timeout=20_000,
            )
            return
        except PlaywrightTimeout:
            if attempt == attempts - 1:
                raise


def wait_cell_done(page, index: int) -> None:
    """Until cell ``index`` shows its execution count (it has finished, not ``[*]``)."""
    page.wait_for_function(
        "([scope, i]) => /\\[\\d+\\]/.test(document.querySelectorAll(scope + ' .jp-Cell')[i]"
        ".querySelector('.jp-InputPrompt').innerText)",
        arg=[ACTIVE, index], timeout=LONG_MS,
    )


def image_digest(page, selector: str) -> dict:
    """src and a checksum of the bytes behind an <img> (blob URLs change with every update)."""
    return page.evaluate(
        """async (sel) => {
            const img = document.querySelector(sel);
            const buf = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
            let sum = 0; for (const b of buf) { sum = (sum * 31 + b) >>> 0; }
            return {src: img.src, length: buf.length, sum: sum};
        }""",
        selector,
    )


@pytest.fixture
def page(browser_page, artifacts, request):
    """The browser page; a screenshot and the page text are kept when a test fails."""
    browser_page.add_init_script(f"window.SCOPE = {ACTIVE!r};")  # the JS checks' selector prefix
    yield browser_page
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        name = request.node.name
        browser_page.screenshot(path=str(artifacts / f"failure-{name}.png"), full_page=True)
        (artifacts / f"failure-{name}.txt").write_text(browser_page.inner_text("body"))


def test_explorer_renders_and_reacts_to_the_tp_slider(lab, page, artifacts):
    t0 = time.perf_counter()
    write_notebook(lab.root / "explorer.ipynb", [
        "import mnb\n"
        "ex = mnb.explorer(model='llama-8b', gpus=8, gpu='h200', bf16=True, global_batch_size=64)\n"
        "ex",
        "print('kernel tp =', ex.tp)",
    ])
    open_notebook(page, lab, "explorer.ipynb")
    run_cell(page, 0)
    label = page.locator(f"{ACTIVE} .mnb-explorer .mnb-memory-label")
    label.wait_for(timeout=LONG_MS)
    page.wait_for_selector(f"{ACTIVE} .mnb-explorer img.mnb-memory-plot[src^='blob:']", timeout=LONG_MS)
    before_text = label.inner_text()
    before_img = image_digest(page, f"{ACTIVE} .mnb-explorer img.mnb-memory-plot")
    assert "tp1 pp1 dp8" in before_text, before_text

    handle = page.locator(f"{ACTIVE} .mnb-explorer .mnb-tp .noUi-handle")
    handle.focus()
    page.keyboard.press("ArrowRight")  # tp 1 -> 2: the next valid value
    page.wait_for_function(
        "() => document.querySelector(SCOPE + ' .mnb-explorer .mnb-memory-label').innerText.includes('tp2 pp1 dp4')",
        timeout=LONG_MS,
    )
    page.wait_for_function(
        "(old) => document.querySelector(SCOPE + ' .mnb-explorer img.mnb-memory-plot').src !== old",
        arg=before_img["src"], timeout=LONG_MS,
    )
    after_text = label.inner_text()
    after_img = image_digest(page, f"{ACTIVE} .mnb-explorer img.mnb-memory-plot")
    assert after_text != before_text
    assert (after_img["length"], after_img["sum"]) != (before_img["length"], before_img["sum"])
    gib = [float(t.split(" GiB")[0].rsplit(" ", 1)[-1]) for t in (before_text, after_text)]
    assert gib[1] < gib[0], (before_text, after_text)  # less memory per rank with tp=2

    run_cell(page, 1)  # the kernel saw the slider move
    page.wait_for_selector(f"{ACTIVE} .jp-OutputArea-output:has-text('kernel tp = 2')", timeout=LONG_MS)
    page.locator(f"{ACTIVE} .mnb-explorer").screenshot(path=str(artifacts / "jupyterlab-explorer.png"))

    # Reload the page: the widget state lives in the kernel and is rendered again from it.
    page.keyboard.press("Control+s")
    page.wait_for_timeout(1500)
    page.reload()
    page.wait_for_selector(f"{ACTIVE} .jp-Cell", timeout=LONG_MS)
    page.wait_for_function(
        "() => { const el = document.querySelector(SCOPE + ' .mnb-explorer .mnb-memory-label');"
        " return el && el.innerText.includes('tp2 pp1 dp4'); }",
        timeout=LONG_MS,
    )
    assert page.locator(f"{ACTIVE} .mnb-explorer .mnb-tp .widget-readout").inner_text().strip() == "2"
    page.locator(f"{ACTIVE} .mnb-explorer").screenshot(path=str(artifacts / "jupyterlab-explorer-reloaded.png"))
    print(f"\nbrowser explorer test: {time.perf_counter() - t0:.1f} s")


def test_run_on_pool_leaves_the_kernel_free_and_live_progress_renders(lab, page, artifacts):
    t0 = time.perf_counter()
    write_notebook(lab.root / "pool.ipynb", [
        "import mnb\n%load_ext mnb\n%mnb start -n 2 --device cpu",
        "ex = mnb.explorer(model='tiny', gpus=2, gpu='cpu', pp=2, global_batch_size=8, run_steps=60)\nex",
        "print('kernel answered while the ranks train:', ex.running)",
        "%%megatron --pp 1\nm = mnb.gpt('tiny')\n_ = mnb.train(m, steps=6, micro_batch_size=2, global_batch_size=8)",
        "%mnb stop",
    ])
    open_notebook(page, lab, "pool.ipynb")
    run_cell(page, 0)
    page.wait_for_selector(f"{ACTIVE} .jp-OutputArea-output:has-text('ranks ready')", timeout=LONG_MS)
    run_cell(page, 1)
    page.wait_for_selector(f"{ACTIVE} .mnb-explorer .mnb-memory-label", timeout=LONG_MS)
    page.locator(f"{ACTIVE} .mnb-explorer .mnb-run").click()
    page.wait_for_function(
        "() => document.querySelector(SCOPE + ' .mnb-explorer .mnb-status').innerText.includes('running')",
        timeout=LONG_MS,
    )
    run_cell(page, 2)  # answered by the kernel while the ranks are still training
    page.wait_for_selector(f"{ACTIVE} .jp-OutputArea-output:has-text('kernel answered while the ranks train: True')",
                           timeout=LONG_MS)
    page.wait_for_function(
        # the measurement's own line (the CPU caveat above it also says "measured")
        "() => document.querySelector(SCOPE + ' .mnb-explorer .mnb-summary').innerText.includes('steps of tp1 pp2')",
        timeout=LONG_MS,
    )
    summary = page.locator(f"{ACTIVE} .mnb-explorer .mnb-summary").inner_text()
    assert "60 steps of tp1 pp2 dp1" in summary, summary
    page.locator(f"{ACTIVE} .mnb-explorer").screenshot(path=str(artifacts / "jupyterlab-explorer-measured.png"))

    run_cell(page, 3)  # %mnb start attached the live widget: bar and plot update in place
    page.wait_for_function(
        "() => { const el = document.querySelector(SCOPE + ' .mnb-live .widget-hprogress');"
        " return !!el; }", timeout=LONG_MS)
    page.wait_for_function(
        "() => document.querySelector(SCOPE + ' .mnb-live').innerText.includes('tok/s')", timeout=LONG_MS)
    page.wait_for_function(  # the run's last step is shown and its plot is a decoded image
        "() => { const live = document.querySelector(SCOPE + ' .mnb-live'); const img = live.querySelector('img');"
        " return live.innerText.includes('step 6/6') && img && img.complete && img.naturalWidth > 0; }",
        timeout=LONG_MS)
    wait_cell_done(page, 3)  # the final text/plain update re-renders the view once; then it is stable
    page.wait_for_function(
        "() => { const img = document.querySelector(SCOPE + ' .mnb-live img');"
        " return img && img.complete && img.naturalWidth > 0; }", timeout=LONG_MS)
    assert page.locator(f"{ACTIVE} .mnb-live").count() == 1
    page.locator(f"{ACTIVE} .mnb-live").screenshot(path=str(artifacts / "jupyterlab-live-progress.png"))
    run_cell(page, 4)
    page.wait_for_selector(f"{ACTIVE} .jp-OutputArea-output:has-text('stopped 2 ranks')", timeout=LONG_MS)
    print(f"\nbrowser pool test: {time.perf_counter() - t0:.1f} s")
