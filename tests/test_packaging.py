"""The wheel: presets and the kernelspec inside it, and a normal (non-editable) install trains.

Builds the wheel from a copy of the sources (nothing is written into the checkout),
checks what it contains, installs it into a fresh virtual environment and, from a
folder outside the repository, trains ``tiny`` for one step on 2 CPU ranks.

The new environment gets torch, Megatron-Core and the rest from the environment
running the tests through a ``.pth`` file naming this interpreter's site folders
(like ``--system-site-packages``, which would give the base interpreter's folders
instead when the tests themselves run in a virtual environment, as CI's 3.12 leg
does).  The wheel is installed before that file is written, so pip in the new
environment sees only the new environment and never touches this one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "MANIFEST.in", "LICENSE", "mnb", "templates", "kernels")
DATA = {"templates": "mnb/templates", "kernels": "mnb/kernels"}  # source folder -> place in the wheel


def _source_files(folder: str, suffix: str = "") -> set[str]:
    return {p.relative_to(REPO / folder).as_posix() for p in (REPO / folder).rglob(f"*{suffix}")
            if p.is_file() and "__pycache__" not in p.parts}


def _can_build_without_isolation() -> bool:
    """setuptools >= 77 (pyproject.toml's build requirement) importable here; else pip fetches it."""
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 77


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.is_file():
            shutil.copy2(path, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), str(src)]
    if _can_build_without_isolation():
        cmd.insert(4, "--no-build-isolation")
    subprocess.run(cmd, check=True, timeout=300)
    (built,) = (tmp / "dist").glob("mnb-*.whl")
    return built


def test_wheel_holds_the_package_presets_and_kernelspec(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, inside in DATA.items():
        missing = {f"{inside}/{f}" for f in _source_files(folder)} - names
        assert not missing, f"{folder}/ files missing from the wheel: {sorted(missing)}"
    assert "mnb/templates/presets/tiny.json" in names and "mnb/kernels/mnb/kernel.json" in names
    assert "mnb/templates/launch/pool.sbatch" in names  # %mnb start --slurm and %mnb export slurm render it
    # pyproject.toml lists mnb's packages by hand: a new subpackage must be added there.
    missing = {f"mnb/{f}" for f in _source_files("mnb", ".py")} - names
    assert not missing, f"modules missing from the wheel (add their package to pyproject.toml): {sorted(missing)}"
    assert not [n for n in names if n.startswith(("templates/", "kernels/", "tests/"))]


def _site_folders() -> list[str]:
    folders = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    return [f for f in folders if os.path.isdir(f)]


PROBE = textwrap.dedent("""
    import json, math, sys
    import mnb, mnb.config, mnb.kernelspec
    from mnb.controller import Pool

    out = {"kernel_mnb": mnb.__file__, "presets": str(mnb.config.package_data("templates")),
           "presets_names": mnb.config.preset_names(),
           "kernel_argv": mnb.kernelspec.get_kernel_dict()["argv"]}
    pool = Pool.start(2, device="cpu", timeout=180)
    try:
        pool.run("model = mnb.gpt('tiny')\\n"
                 "r = mnb.train(model, steps=1, micro_batch_size=2, global_batch_size=4)", quiet=True)
        out["rank_mnb"] = pool.run("mnb.__file__")
        out["losses"] = pool.run("[s['loss'] for s in r['steps']]")
    finally:
        pool.stop()
    print("PROBE " + json.dumps(out))
""")


def test_installed_wheel_trains_tiny_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=300)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_mnb_test_parent_env.pth").write_text("".join(f"{f}\n" for f in _site_folders()))

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}
    proc = subprocess.run([str(python), "-c", PROBE], cwd=outside, env=env, capture_output=True, text=True,
                          timeout=420)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    out = json.loads(line[len("PROBE "):])

    def in_venv(path: str) -> bool:
        return Path(path).resolve().is_relative_to(venv.resolve())

    assert in_venv(out["kernel_mnb"]), out["kernel_mnb"]
    assert len(out["rank_mnb"]) == 2 and all(map(in_venv, out["rank_mnb"].values())), out["rank_mnb"]
    assert in_venv(out["presets"]) and "tiny" in out["presets_names"], out
    assert Path(out["kernel_argv"][0]).parent == python.parent, out["kernel_argv"]
    losses = [loss for per_rank in out["losses"].values() for loss in per_rank]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
