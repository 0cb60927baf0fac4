"""The examples in the estimator docstrings stay true."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["hardware", "memory", "flops", "pipeline", "plan", "sharding"])
def test_docstring_examples(name):
    module = importlib.import_module(f"mnb.estimate.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
