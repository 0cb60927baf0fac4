"""Units, their formatting, and where the code runs: one place for both sides (stdlib only).

    >>> format_bytes(3 * 2**30), format_bytes(45.6 * 2**20), format_bytes(512)
    ('3.00 GiB', '45.6 MiB', '512 B')
    >>> format_mib(600 * MIB), format_mib(int(2.5 * MIB))
    ('600 MiB', '2.5 MiB')

``in_kernel()`` / ``ipython_shell()`` answer "is this a Jupyter kernel / an IPython shell"
without importing IPython (both are only true when something else already imported it).
"""

from __future__ import annotations

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
