"""Install the "Python 3 (mnb)" Jupyter kernel: ipykernel with mnb already loaded.

    python -m mnb.kernelspec install [--user] [--prefix PREFIX] [--name mnb]

(also available as the ``mnb-kernel-install`` command).  The kernelspec in
kernels/mnb/ (shipped in the wheel as ``mnb/kernels/mnb/``) names ``python``;
the installed copy names this interpreter, so the kernel finds mnb and torch
exactly as this environment has them.

The kernel starts ipykernel with ``--ext mnb.kernelspec``: this module's
:func:`load_ipython_extension` does what ``%load_ext mnb`` does (``%mnb``,
``%%megatron``, and ``mnb`` bound in the notebook) under its own extension
name, so a notebook's own ``%load_ext mnb`` still loads ``mnb`` for the first
time and prints nothing: the same notebook runs on either kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from mnb.paths import package_data

KERNEL_NAME = "mnb"
KERNEL_EXTENSION = "mnb.kernelspec"
"""The extension the kernel loads at start: this module (see :func:`load_ipython_extension`)."""


def load_ipython_extension(ipython: Any) -> None:
    """The "Python 3 (mnb)" kernel's start: the magics and ``mnb`` bound, as ``%load_ext mnb`` does.

    Loaded under the name ``mnb.kernelspec``, not ``mnb``, so IPython does not
    answer a notebook's ``%load_ext mnb`` with "already loaded".
    """
    import mnb

    mnb.load_ipython_extension(ipython)


def make_cmd(executable: str | None = None) -> list[str]:
    """ipykernel's launcher with mnb's start-up extension: %mnb, %%megatron and ``mnb`` exist from the start."""
    return [executable or sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
            "--ext", KERNEL_EXTENSION]


def get_kernel_dict(executable: str | None = None) -> dict[str, Any]:
    spec = json.loads((package_data("kernels") / KERNEL_NAME / "kernel.json").read_text(encoding="utf-8"))
    spec["argv"] = make_cmd(executable)
    return spec


def write_kernel_spec(path: Path, executable: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "kernel.json").write_text(json.dumps(get_kernel_dict(executable), indent=2) + "\n")
    return path


def install(user: bool = False, prefix: str | None = None, name: str = KERNEL_NAME) -> str:
    """Install the kernelspec; returns the directory Jupyter installed it to."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as tmp:
        source = write_kernel_spec(Path(tmp) / name)
        return KernelSpecManager().install_kernel_spec(str(source), kernel_name=name, user=user, prefix=prefix)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mnb.kernelspec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install", help="install the kernelspec")
    p.add_argument("--user", action="store_true", help="install for this user only")
    p.add_argument("--prefix", default=None, help="install under PREFIX/share/jupyter/kernels")
    p.add_argument("--name", default=KERNEL_NAME)
    args = parser.parse_args(argv)
    where = install(user=args.user, prefix=args.prefix, name=args.name)
    print(f"installed kernel {args.name!r} in {where}; choose 'Python 3 (mnb)' in JupyterLab's launcher")


if __name__ == "__main__":
    main()
