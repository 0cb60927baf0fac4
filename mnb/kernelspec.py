"""Install the "Python 3 (mnb)" Jupyter kernel: ipykernel with mnb already loaded.

    python -m mnb.kernelspec install [--user] [--prefix PREFIX] [--name mnb]

(also available as the ``mnb-kernel-install`` command).  The kernelspec in
kernels/mnb/ names ``python``; the installed copy names this interpreter, so
the kernel finds mnb and torch exactly as this environment has them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

KERNEL_NAME = "mnb"
SPEC_DIR = Path(__file__).resolve().parent.parent / "kernels" / KERNEL_NAME


def make_cmd(executable: str | None = None) -> list[str]:
    """ipykernel's launcher with ``--ext mnb`` so %mnb and %%megatron exist from the start."""
    return [executable or sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--ext", "mnb"]


def get_kernel_dict(executable: str | None = None) -> dict[str, Any]:
    spec = json.loads((SPEC_DIR / "kernel.json").read_text())
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
