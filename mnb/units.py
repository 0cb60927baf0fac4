"""Units and their formatting, one place for both sides (stdlib only).

    >>> format_bytes(3 * 2**30), format_bytes(45.6 * 2**20), format_bytes(512)
    ('3.00 GiB', '45.6 MiB', '512 B')
"""

from __future__ import annotations

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
