"""Layout (re)initialisation in live gloo ranks: tp2 -> pp2 -> dp2 -> ep2 without restart."""

import pytest
from conftest import ok

from mnb.megatron import layout

COORDS0 = {"tp": 0, "pp": 0, "dp": 0, "cp": 0, "ep": 0}


def test_no_layout_in_a_plain_process():
    assert layout.current_layout() is None
    assert layout.coordinates() == COORDS0
    with pytest.raises(RuntimeError, match="no parallel layout"):
        layout.require_layout()


def test_apply_layout_needs_torch_distributed():
    from mnb.config import ParallelConfig

    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        layout.apply_layout(ParallelConfig())


def test_a_megatron_argument_this_version_lacks_is_refused_by_name_not_dropped():
    """An unaccepted ``expert_model_parallel_size`` must not silently become ep=1."""
    from megatron.core import parallel_state

    with pytest.raises(TypeError, match=r"initialize_model_parallel of megatron-core \S+ takes no "
                                        r"expert_parallel_degree: mnb supports megatron-core>=0.16"):
        layout._call_megatron(parallel_state.initialize_model_parallel, tensor_model_parallel_size=1,
                              expert_parallel_degree=2)


def test_gpt_without_layout_says_what_to_do():
    from mnb.megatron.model import gpt

    with pytest.raises(RuntimeError, match="%%megatron"):
        gpt("tiny")


@pytest.mark.slow
def test_layout_walk(world2):
    walks = [ok(rank["layout_walk"]) for rank in world2]
    for rank, walk in enumerate(walks):
        start, tp2, tp2_again, sp, pp2, stale, dp2, ep2, bad_tp, bad_cp, after = walk
        assert start["coords"] == COORDS0 and start["layout"] is None
        assert tp2["rebuilt"] is True and tp2["layout"]["tp"] == 2 and tp2["layout"]["dp"] == 1
        assert tp2["coords"] == {**COORDS0, "tp": rank}
        assert tp2_again["rebuilt"] is False
        assert sp["rebuilt"] is False and sp["layout"]["sequence_parallel"] is True
        assert pp2["rebuilt"] is True and pp2["coords"] == {**COORDS0, "pp": rank}
        assert "build it again" in stale["stale_model"]
        assert dp2["stale_save"] == stale["stale_model"] and "to 'tp1 pp2 dp1'" in dp2["stale_save"], dp2
        assert dp2["rebuilt"] is True and dp2["layout"]["dp"] == 2
        assert dp2["coords"] == {**COORDS0, "dp": rank}
        assert ep2["rebuilt"] is True and ep2["coords"] == {**COORDS0, "dp": rank, "ep": rank}
        assert "does not divide world size 2" in bad_tp["error"]
        assert "cp(4) = 4 does not divide world size 2" in bad_cp["error"]
        assert after["after_bad"] == ep2["layout"]  # a refused layout leaves the groups alone
