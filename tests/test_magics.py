"""%mnb and %%megatron through a real IPython shell, with real CPU ranks."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from mnb.errors import CompositeRankError
from mnb.magics import megatron_parser, parse_ranks, start_parser
from tests.conftest import assert_no_orphans


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "mnb")
    yield ip
    ip.run_line_magic("mnb", "stop")


def test_flags_are_a_frozen_contract():
    start_flags = {a.option_strings[0] for a in start_parser()._actions if a.option_strings}
    assert {"-n", "--device", "--gpus", "--timeout"} <= start_flags
    cell_flags = {s for a in megatron_parser()._actions for s in a.option_strings}
    assert {"--tp", "--pp", "--vpp", "--cp", "--ep", "--sp", "--no-sp", "--ranks", "--timeout"} <= cell_flags


def test_public_surface_is_deliberate():
    import mnb

    assert set(mnb.__all__) >= {"pool", "last_run", "estimate", "gpt", "train", "save", "load",
                                "explorer", "sweep", "load_ipython_extension"}


def test_rank_lists():
    assert parse_ranks("0,2-3") == [0, 2, 3]
    for bad in ("a", "3-1", "-1", ","):
        with pytest.raises(UsageError):
            parse_ranks(bad)


@pytest.mark.slow
def test_magics_end_to_end(shell, capsys):
    with pytest.raises(UsageError, match="no pool is running"):
        shell.run_cell_magic("megatron", "", "x = 1")
    with pytest.raises(UsageError, match="no GPU is visible here.*use --device cpu"):
        shell.run_line_magic("mnb", "start -n 3 --device cuda")
    with pytest.raises(UsageError, match=r"unknown GPU id\(s\) \[7\]"):
        shell.run_line_magic("mnb", "start --gpus 7")

    shell.run_line_magic("mnb", "start -n 2 --device cpu")
    out = capsys.readouterr().out
    assert "rank  pid" in out and "gloo" in out and "2 ranks ready" in out

    shell.run_cell_magic("megatron", "--tp 2", "print('tp size', ps.get_tensor_model_parallel_world_size())")
    assert "[r0-1] tp size 2" in capsys.readouterr().out

    # Flags are sticky: a bare cell keeps tp=2.  Names persist between cells.
    shell.run_cell_magic("megatron", "", "y = ps.get_tensor_model_parallel_rank()")
    shell.run_cell_magic("megatron", "", "print('y', y, 'world', world_size, 'dp', ps.get_data_parallel_world_size())")
    out = capsys.readouterr().out
    assert "[r0 tp0 pp0 dp0] y 0 world 2 dp 1" in out and "[r1 tp1 pp0 dp0] y 1 world 2 dp 1" in out

    with pytest.raises(UsageError, match=r"tp\(2\) \* pp\(2\) \* cp\(1\) = 4 does not divide world size 2"):
        shell.run_cell_magic("megatron", "--pp 2", "pass")
    with pytest.raises(UsageError, match="rank 5 does not exist"):
        shell.run_cell_magic("megatron", "--ranks 0,5", "pass")
    with pytest.raises(UsageError, match=r"num_attention_heads\(3\) is not divisible by tp\(2\)"):
        shell.run_cell_magic("megatron", "--tp 2",
                             "model = mnb.gpt('tiny', hidden_size=96, num_attention_heads=3, num_query_groups=3)")
    with pytest.raises(UsageError, match=r"num_layers\(3\) is not divisible by pp\(2\)"):
        shell.run_cell_magic("megatron", "--tp 1 --pp 2", "model = mnb.gpt('tiny', num_layers=3)")
    with pytest.raises(UsageError, match=r"global_batch_size\(3\) is not divisible"):
        shell.run_cell_magic("megatron", "--tp 1 --pp 1", "mnb.train(None, micro_batch_size=1, global_batch_size=3)")

    shell.run_cell_magic("megatron", "--ranks 1", "print('only', rank)")
    out = capsys.readouterr().out
    assert "[r1 tp1 pp0 dp0] only 1" in out and "r0" not in out

    with pytest.raises(CompositeRankError, match="ZeroDivisionError"):
        shell.run_cell_magic("megatron", "", "1 / (rank - 1)")

    shell.run_cell_magic("megatron", "", "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nrank + 40")
    out = capsys.readouterr().out
    assert "Figure" in out and "40" in out  # figure + last value shown from rank 0 only
    assert "41" not in out

    shell.run_line_magic("mnb", "status")
    out = capsys.readouterr().out
    assert "idle" in out and "layout: tp2 pp1 dp1" in out

    pool = __import__("mnb").pool()
    pids = pool.pids()
    shell.run_line_magic("mnb", "restart")
    assert "restarted: 2 ranks" in capsys.readouterr().out
    assert_no_orphans(pids)
    shell.run_cell_magic("megatron", "", "print('after restart', rank)")
    assert "after restart" in capsys.readouterr().out
    pids = pool.pids()
    shell.run_line_magic("mnb", "stop")
    assert_no_orphans(pids)
