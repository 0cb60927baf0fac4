"""The tutorial notebooks execute headless on CPU ranks, as a learner would run them."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("0*.ipynb")))
def test_notebook_executes(name, tmp_path):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{name} showed no figure"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "ranks ready" in text
