"""The tutorial notebooks execute headless on CPU ranks, as a learner would run them.

Each exercise check must raise on the notebook's wrong answer and pass on its solution
(tests/notebook_runner.py says how the cells are marked).  CI runs each notebook once: .ci/run
splits them between its two legs (LEG1_SKIP, LEG2_SKIP)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.notebook_runner import execute

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
WORKSHOP_FROM = 5
"""Notebooks 05 onwards are the workshop: each ends with checked exercises."""

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]-*.ipynb")))
def test_notebook_executes(name, tmp_path):
    result = execute(NOTEBOOKS / name, tmp_path)
    assert not result.problems, result.problems
    outputs = [o for cell in result.notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{name} showed no figure"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "ranks ready" in text
    if int(name[:2]) >= WORKSHOP_FROM:
        assert result.checks >= 2, f"{name} has {result.checks} checked exercises; a workshop notebook needs two or more"
        assert result.rejected_wrong == result.checks
