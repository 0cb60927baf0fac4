"""Units and the "where am I" check: one place for both sides."""

from __future__ import annotations

import doctest
import subprocess
import sys
import types

import mnb.units
from mnb.units import GIB, format_bytes, format_percent, format_seconds, in_kernel, ipython_shell


def test_doctests():
    assert doctest.testmod(mnb.units).failed == 0


def test_format_bytes():
    assert format_bytes(None) == "?" and format_bytes(1.5 * GIB) == "1.50 GiB" and format_bytes(7 * 1024) == "7.0 KiB"


def test_times_and_percentages_scale_so_small_values_stay_readable():
    assert [format_seconds(v) for v in (95.0, 1.5, 0.9996, 0.0123, 4.56e-5, 7e-9, None)] == [
        "95.0 s", "1.50 s", "1.00 s", "12.3 ms", "45.6 µs", "7.00 ns", "?"]
    assert [format_percent(v) for v in (0.416, 0.001, 3.14e-5, 0.0)] == ["41.6%", "0.1%", "0.0031%", "0.0%"]


def test_kernel_check_needs_a_shell_with_a_kernel(monkeypatch):
    shell = types.SimpleNamespace()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    assert ipython_shell() is shell and not in_kernel()  # a terminal IPython shell
    shell.kernel = object()
    assert in_kernel()
    monkeypatch.delitem(sys.modules, "ipykernel")
    assert not in_kernel()


def test_units_and_the_estimators_need_only_the_standard_library():
    """mnb.estimate reads its units from mnb.units: neither may pull in torch, numpy or IPython."""
    code = ("import sys, mnb.units, mnb.estimate\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'megatron', 'numpy', 'IPython', 'ipywidgets', 'matplotlib', 'zmq')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
