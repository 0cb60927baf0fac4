"""Units, their formatting, and where the code runs: one place for both sides (stdlib only).

    >>> format_bytes(3 * 2**30), format_bytes(45.6 * 2**20), format_bytes(512)
    ('3.00 GiB', '45.6 MiB', '512 B')
    >>> format_mib(600 * MIB), format_mib(int(2.5 * MIB))
    ('600 MiB', '2.5 MiB')
    >>> format_seconds(12.345), format_seconds(0.0314), format_seconds(3e-6), format_seconds(0)
    ('12.3 s', '31.4 ms', '3.00 µs', '0 s')

``in_kernel()`` / ``ipython_shell()`` answer "is this a Jupyter kernel / an IPython shell"
without importing IPython (both are only true when something else already imported it).
"""

from __future__ import annotations

import os
import sys
from typing import Any

KIB = 2**10
MIB = 2**20
GIB = 2**30


def format_bytes(value: float | None) -> str:
    """'1.23 GiB', '45.6 MiB', '7.0 KiB', '512 B'; '?' for None."""
    if value is None:
        return "?"
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}" if unit == "GiB" else f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def format_mib(size_bytes: float) -> str:
    """'600 MiB' (one decimal below 10 MiB): sizes compared with a MiB limit."""
    mib = size_bytes / MIB
    return f"{mib:.1f} MiB" if mib < 10 else f"{mib:.0f} MiB"


def format_seconds(value: float | None) -> str:
    """Three significant digits in s, ms, µs or ns ('1.23 s', '45.6 ms', '7.00 µs'); '?' for None.

    A step of a tiny model takes microseconds: a fixed '0.000 s' column said nothing about it.
    """
    if value is None:
        return "?"
    if value == 0:
        return "0 s"
    units = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))
    index = next((i for i, (_, size) in enumerate(units) if abs(value) >= size), len(units) - 1)
    scaled = value / units[index][1]
    if index > 0 and abs(scaled) >= 999.5:  # 999.9 ms rounds to 1.00 s, never to '1000 ms'
        index, scaled = index - 1, scaled / 1000
    digits = 0 if abs(scaled) >= 99.95 else 1 if abs(scaled) >= 9.995 else 2
    return f"{scaled:.{digits}f} {units[index][0]}"


def format_percent(fraction: float) -> str:
    """'41.6%'; two significant digits below 0.1% ('0.0031%'), where one decimal shows 0.0%."""
    if fraction == 0 or abs(fraction) >= 0.001:
        return f"{fraction:.1%}"
    return f"{fraction * 100:.2g}%"


def cwd_note(path: str | os.PathLike) -> str:
    """``" (relative paths start in CWD)"`` for a relative ``path``, ``""`` for an absolute one: the
    directory a missing path was looked for in (on a rank, the notebook's when that host has it).

    >>> cwd_note("/abs/model")
    ''
    """
    return "" if os.path.isabs(os.path.expanduser(os.fspath(path))) else f" (relative paths start in {os.getcwd()})"


def ipython_shell() -> Any:
    """The running IPython shell (terminal or kernel), or None; never imports IPython itself."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return get_ipython() if get_ipython else None


def in_kernel() -> bool:
    """True inside a Jupyter (ipykernel) kernel: displays, pyplot figures and widget messages show there."""
    if "ipykernel" not in sys.modules:
        return False
    shell = ipython_shell()
    return shell is not None and hasattr(shell, "kernel")


class Text(str):
    """A ``str`` that shows as its text: a summary as a cell's last value reads as lines.

    A plain ``str`` as a cell's value shows as a quoted literal with ``\\n`` escapes; this one's
    ``repr`` (and IPython's ``_repr_pretty_``) is the text itself.  Everything else is ``str``:
    ``print(...)``, ``in``, ``.splitlines()``, equality with plain strings.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))
