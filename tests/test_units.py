"""Units and the "where am I" check: one place for both sides."""

from __future__ import annotations

import doctest
import sys
import types

import mnb.units
from mnb.units import GIB, format_bytes, in_kernel, ipython_shell


def test_doctests():
    assert doctest.testmod(mnb.units).failed == 0


def test_format_bytes():
    assert format_bytes(None) == "?" and format_bytes(1.5 * GIB) == "1.50 GiB" and format_bytes(7 * 1024) == "7.0 KiB"


def test_kernel_check_needs_a_shell_with_a_kernel(monkeypatch):
    shell = types.SimpleNamespace()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    assert ipython_shell() is shell and not in_kernel()  # a terminal IPython shell
    shell.kernel = object()
    assert in_kernel()
    monkeypatch.delitem(sys.modules, "ipykernel")
    assert not in_kernel()
