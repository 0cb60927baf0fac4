"""Fixtures for the mnb.megatron tests: real gloo ranks, launched once per session.

``world1`` and ``world2`` run the bodies in ``scenarios.py`` on 1 and 2 fresh
rank processes (cpu.install + init_process_group("gloo")) and hand their results
to every test that asks, so the whole file set costs two launches.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import scenarios  # noqa: E402
from ranks import run_ranks  # noqa: E402


@pytest.fixture(scope="session")
def world1(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("world1")
    return run_ranks(scenarios.world1, 1, tmp, tmp=str(tmp))[0]


@pytest.fixture(scope="session")
def world2(tmp_path_factory):
    return run_ranks(scenarios.world2, 2, tmp_path_factory.mktemp("world2"))


@pytest.fixture(scope="session")
def triton_interpreted(tmp_path_factory):
    """mnb's Triton kernels (decode and norms) on 2 gloo ranks under Triton's interpreter: one launch for
    test_decode_kernels.py and test_norm_kernels.py (both skip where Triton is missing)."""
    import os

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # the ranks' environment from their start
    try:
        return run_ranks(scenarios.triton_interpreted, 2, tmp_path_factory.mktemp("triton"), timeout_s=900)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved


def ok(result):
    """The result of a guarded check, or a failure showing the rank's traceback."""
    if isinstance(result, dict) and "error" in result and len(result) == 1:
        pytest.fail("rank-side check raised:\n" + result["error"], pytrace=False)
    return result


@pytest.fixture(scope="module")
def pool4(request):
    """The session's 4-rank CPU pool (tp2*pp2 and cp2*tp2 layouts), reset for this module."""
    from tests.shared_pools import for_module

    yield from for_module(4, request, timeout=240)
