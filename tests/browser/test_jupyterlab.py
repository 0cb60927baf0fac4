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

IDLE = ".jp-Notebook-ExecutionIndicator[data-status='idle']"
LONG_MS = 120_000


def write_notebook(path, sources: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def open_notebook(page, lab, name: str) -> None:
    page.goto(lab.url(f"lab/tree/{name}"))
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=LONG_MS)
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

    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    for attempt in range(attempts):
        cell.locator(".jp-InputPrompt").click()
        page.keyboard.press("Escape")
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function(
                "(i) => /\\[(\\d+|\\*)\\]/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]"
                ".querySelector('.jp-InputPrompt').innerText)",
                arg=index, timeout=20_000,
            )
            return
        except PlaywrightTimeout:
            if attempt == attempts - 1:
                raise


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
    label = page.locator(".mnb-explorer .mnb-memory-label")
    label.wait_for(timeout=LONG_MS)
    page.wait_for_selector(".mnb-explorer img.mnb-memory-plot[src^='blob:']", timeout=LONG_MS)
    before_text = label.inner_text()
    before_img = image_digest(page, ".mnb-explorer img.mnb-memory-plot")
    assert "tp1 pp1 dp8" in before_text, before_text

    handle = page.locator(".mnb-explorer .mnb-tp .noUi-handle")
    handle.focus()
    page.keyboard.press("ArrowRight")  # tp 1 -> 2: the next valid value
    page.wait_for_function(
        "() => document.querySelector('.mnb-explorer .mnb-memory-label').innerText.includes('tp2 pp1 dp4')",
        timeout=LONG_MS,
    )
    page.wait_for_function(
        "(old) => document.querySelector('.mnb-explorer img.mnb-memory-plot').src !== old",
        arg=before_img["src"], timeout=LONG_MS,
    )
    after_text = label.inner_text()
    after_img = image_digest(page, ".mnb-explorer img.mnb-memory-plot")
    assert after_text != before_text
    assert (after_img["length"], after_img["sum"]) != (before_img["length"], before_img["sum"])
    gib = [float(t.split(" GiB")[0].rsplit(" ", 1)[-1]) for t in (before_text, after_text)]
    assert gib[1] < gib[0], (before_text, after_text)  # less memory per rank with tp=2

    run_cell(page, 1)  # the kernel saw the slider move
    page.wait_for_selector(".jp-OutputArea-output:has-text('kernel tp = 2')", timeout=LONG_MS)
    page.locator(".mnb-explorer").screenshot(path=str(artifacts / "jupyterlab-explorer.png"))

    # Reload the page: the widget state lives in the kernel and is rendered again from it.
    page.keyboard.press("Control+s")
    page.wait_for_timeout(1500)
    page.reload()
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=LONG_MS)
    page.wait_for_function(
        "() => { const el = document.querySelector('.mnb-explorer .mnb-memory-label');"
        " return el && el.innerText.includes('tp2 pp1 dp4'); }",
        timeout=LONG_MS,
    )
    assert page.locator(".mnb-explorer .mnb-tp .widget-readout").inner_text().strip() == "2"
    page.locator(".mnb-explorer").screenshot(path=str(artifacts / "jupyterlab-explorer-reloaded.png"))
    print(f"\nbrowser explorer test: {time.perf_counter() - t0:.1f} s")
