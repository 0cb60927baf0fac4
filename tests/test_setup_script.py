"""What the set-up installs, read from its dry run (nothing is installed, apt-get never runs).

The main command (``bash scripts/quickstart.sh``) installs only what the notebooks need; the
browser and Slurm are for the test command.  A fresh clone is a Python without torch or mnb:
a venv made here without pip, so every "present" check fails as on a new laptop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory) -> str:
    where = tmp_path_factory.mktemp("fresh") / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    return str(where / "bin" / "python")


def _plan(*command: str, python: str, **extra: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MNB_SKIP_SETUP", "MNB_TORCH_INDEX_URL", "PYTHONPATH")}
    done = subprocess.run(["bash", *command], cwd=ROOT, env={**env, "PYTHON": python, **extra},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


def test_main_command_installs_no_browser_and_no_slurm(fresh_python):
    plan = _plan("scripts/quickstart.sh", "--dry-run", python=fresh_python)
    runs = [line.split("would run: ", 1)[1] for line in plan if "would run: " in line]
    assert runs == [f"{fresh_python} -m pip install --progress-bar on torch==2.13.0",
                    f"{fresh_python} -m pip install --progress-bar on -e .",
                    f"{fresh_python} -m jupyter nbconvert --to notebook --execute notebooks/01-quickstart.ipynb "
                    "--ExecutePreprocessor.timeout=900 --output-dir artifacts/quickstart"], plan
    text = "\n".join(plan)
    assert "chromium" not in text.lower() and "apt-get" not in text and "munge" not in text, text
    torch_line = next(line for line in plan if line.startswith("setup: torch:"))
    assert "about 4.5 GB" in torch_line and "https://download.pytorch.org/whl/cpu" in torch_line, torch_line
    assert any("roughly 100 MB" in line for line in plan), plan  # the mnb step says its download size first


def test_test_command_adds_the_browser_and_slurm(fresh_python):
    plan = _plan("scripts/setup.sh", "--for", "tests", "--dry-run", python=fresh_python)
    assert any(line.endswith("-m pip install --progress-bar on -e .[test]") for line in plan), plan
    assert any(line.startswith("setup: chromium (browser test): ") for line in plan), plan
    assert any(line.startswith("setup: slurm + munge (Slurm tests): ") for line in plan), plan
    torch_line = next(line for line in plan if line.startswith("setup: torch:"))
    assert "CUDA build" in torch_line, torch_line


def test_laptop_users_get_the_cpu_build_of_torch(fresh_python):
    plan = _plan("scripts/quickstart.sh", "--dry-run", python=fresh_python,
                 MNB_TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu")
    assert (f"setup:   would run: {fresh_python} -m pip install --progress-bar on torch==2.13.0 "
            "--index-url https://download.pytorch.org/whl/cpu") in plan, plan


def test_setup_refuses_an_unknown_mode():
    done = subprocess.run(["bash", "scripts/setup.sh", "--for", "laptop", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 2 and "--for takes quickstart or tests, not 'laptop'" in done.stderr


def test_quickstart_writes_its_executed_copy_where_git_ignores_it(fresh_python):
    """A fresh clone stays clean after ``bash scripts/quickstart.sh``: the notebook it writes is ignored, not
    tracked (notebooks/executed/ holds the project's committed copies), and the README says where it is."""
    plan = _plan("scripts/quickstart.sh", "--dry-run", python=fresh_python, MNB_SKIP_SETUP="1")
    run = next(line.split("would run: ", 1)[1] for line in plan if "would run: " in line and "nbconvert" in line)
    out_dir = run.split("--output-dir ", 1)[1].split()[0]
    written = f"{out_dir}/01-quickstart.ipynb"
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", written], cwd=ROOT, capture_output=True)
    assert tracked.returncode != 0, f"{written} is tracked: the quickstart would leave git status dirty"
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", written], cwd=ROOT)
    assert ignored.returncode == 0, f"{written} is not ignored: git status would list it"
    assert f"executed copy (outputs, plots): {out_dir}/" in (ROOT / "README.md").read_text()
