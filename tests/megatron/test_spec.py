"""The local spec: SDPA core attention and sequence-parallel-capable norms."""

import pytest
from conftest import ok

from mnb.megatron.spec import have_te

pytestmark = pytest.mark.slow


def test_sdpa_matches_megatron_dot_product_attention(world1):
    result = ok(world1["sdpa"])
    assert result["shape"] == result["expected_shape"] == [16, 2, 64]
    assert result["max_abs_diff"] < 1e-5


def test_norm_weights_flagged_for_sequence_parallel(world1):
    assert ok(world1["sdpa"])["norm_sp_flags"] == [True]


def test_have_te_says_whether_transformer_engine_imports(monkeypatch):
    """True or False by the machine (TE installed or not); False whenever TE cannot be imported."""
    import subprocess
    import sys

    imports = subprocess.run([sys.executable, "-c", "import transformer_engine.pytorch"],
                             capture_output=True, timeout=300).returncode == 0
    assert have_te() is imports
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # an import of it now raises ImportError
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    assert have_te() is False
