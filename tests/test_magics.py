"""%mnb and %%megatron through a real IPython shell, with real CPU ranks."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from mnb.config import ParallelConfig
from mnb.errors import CompositeRankError
from mnb.notebook.magics import LAYOUT_FLAGS, megatron_parser, parse_ranks, requested_layout
from tests.conftest import assert_no_orphans


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "mnb")
    yield ip
    ip.run_line_magic("mnb", "stop")


FLAGS = {
    "%mnb start": ["--account", "--cell-timeout", "--device", "--gpus", "--gpus-per-node", "--grace", "--ip",
                   "--nnodes", "--nodes", "--ntasks-per-node", "--partition", "--rdzv-endpoint", "--sbatch-arg",
                   "--slurm", "--standby", "--threads", "--time", "--timeout", "--timings", "--verbose", "-n"],
    "%mnb status": [], "%mnb stop": [], "%mnb restart": [], "%mnb stacks": [], "%mnb debug": [],
    "%mnb plot": ["loss", "memory", "mfu", "timeline"],
    "%mnb plan": ["--calibrate", "--fp8", "--gbs", "--gpu", "--gpus", "--mbs", "--model", "--seq", "--top"],
    "%mnb run": ["--grace", "--isolated", "--ranks", "--timeout"],
    "%mnb profile": ["delete", "list", "open"],
    "%mnb export": ["--cp", "--data", "--dp", "--ep", "--fp8", "--fsdp", "--gbs", "--gpus-per-node", "--lr", "--mbs", "--model", "--no-sp",
                    "--nodes", "--output", "--overwrite", "--pp", "--sbatch-arg", "--seq", "--sp", "--steps", "--tp", "--vpp", "-o",
                    "megatron-lm", "slurm", "torchrun"],
    "%%megatron": ["--cp", "--debug-ranks", "--dp", "--ep", "--fsdp", "--grace", "--memory", "--no-sp", "--output", "--pp", "--profile", "--profile-ranks",
                   "--ranks", "--sp", "--timeout", "--tp", "--vpp", "-o"],
}
"""Every magic's flags and positional choices (-h/--help aside): a contract, so any change is deliberate."""

PUBLIC = ["CompositeRankError", "ModelConfig", "ParallelConfig", "RankError", "TrainConfig", "__version__",
          "estimate", "evaluate", "explorer", "export", "from_hf", "generate", "gpt", "hf_config", "last_profile",
          "last_run", "load", "load_adapter", "load_ipython_extension", "logits", "lora", "merge_lora", "pool", "record",
          "save", "save_adapter", "save_hf", "sweep", "train", "unload_ipython_extension"]
"""``mnb.__all__``, sorted: adding a public name means adding it here (and to docs/api.md)."""


def _flags(parser) -> list[str]:
    options = [s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")]
    choices = [str(c) for a in parser._actions if not a.option_strings for c in (a.choices or [])]
    return sorted(options + choices)


def test_flags_are_a_frozen_contract():
    from mnb.notebook.magics import SUBCOMMAND_PARSERS

    found = {f"%mnb {name}": _flags(make()) for name, make in SUBCOMMAND_PARSERS.items()}
    found["%%megatron"] = _flags(megatron_parser())
    assert found == FLAGS


def test_dp_is_not_a_flag_and_the_error_says_how_it_is_set(shell):
    """--dp (hidden from the help) answers what users try with how data parallelism is set, before any cell runs."""
    for line, call in (("--dp 2", lambda: shell.run_cell_magic("megatron", "--dp 2", "1")),
                       ("export", lambda: shell.run_line_magic("mnb", "export --model tiny --gpus-per-node 8 --dp 2"))):
        with pytest.raises(UsageError, match=r"--dp is not a flag: .*dp = ranks / \(tp \* pp \* cp\)"):
            call()
    assert "--dp" not in megatron_parser().format_help()


def test_ntasks_per_node_is_slurms_name_for_ranks_per_node_and_only_applies_with_slurm(shell):
    with pytest.raises(UsageError, match=r"--ntasks-per-node only apply with --slurm"):
        shell.run_line_magic("mnb", "start --ntasks-per-node 1")
    with pytest.raises(UsageError, match=r"-n 2 and --ntasks-per-node 1 both give the ranks per node; keep one"):
        shell.run_line_magic("mnb", "start --slurm --nodes 2 -n 2 --ntasks-per-node 1")


def test_public_surface_is_deliberate():
    import mnb

    assert sorted(mnb.__all__) == PUBLIC
    assert sorted(mnb._LAZY) == sorted(set(PUBLIC) - {"__version__", "last_profile", "last_run", "load_ipython_extension",
                                                      "unload_ipython_extension"})
    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    listed = api.split("The public names are `mnb.__all__`: ", 1)[1].split(".\n", 1)[0]
    assert sorted(re.findall(r"`(\w+)`", listed)) == PUBLIC, listed  # docs/api.md names every one


def _cell(line: str):
    return megatron_parser().parse_args(line.split())


def _run_cells(lines: list[str], world: int) -> list[str]:
    """The layout each cell of a sequence runs under, starting from a fresh pool's."""
    layout, seen = ParallelConfig().resolve(world), []
    for line in lines:
        layout = requested_layout(layout, _cell(line), world)
        seen.append(layout.describe())
    return seen


def test_a_cell_naming_a_layout_flag_runs_under_exactly_that_layout():
    # --pp 2 after --tp 2 on 2 ranks is tp1 pp2, not tp2 pp2 (an error) as sticky flags made it.
    assert _run_cells(["--tp 2", "", "--pp 2", "", "--tp 2 --sp", "--ranks 1", "--ep 2", "--no-sp"], world=2) == [
        "tp2 pp1 dp1", "tp2 pp1 dp1", "tp1 pp2 dp1", "tp1 pp2 dp1", "tp2 pp1 dp1 sp", "tp2 pp1 dp1 sp",
        "tp1 pp1 ep2 dp2", "tp1 pp1 dp2"]
    # The same cell means the same after any history (e.g. after a kernel restart).
    for history in ([], ["--tp 2"], ["--tp 4 --sp"], ["--pp 2 --vpp 2"], ["--tp 2 --pp 2", ""]):
        assert _run_cells(history + ["--pp 2"], world=4)[-1] == "tp1 pp2 dp2"
        assert _run_cells(history + ["--tp 2 --vpp 2 --pp 2"], world=8)[-1] == "tp2 pp2 vpp2 dp2"
    fresh = requested_layout(ParallelConfig(tp=2, sequence_parallel=True).resolve(4), _cell("--cp 2"), 4)
    assert (fresh.tp, fresh.pp, fresh.vpp, fresh.cp, fresh.ep, fresh.sequence_parallel, fresh.dp) == \
        (1, 1, 1, 2, 1, False, 2)
    with pytest.raises(UsageError, match=r"tp\(2\) \* pp\(2\) \* cp\(1\) = 4 does not divide world size 2"):
        _run_cells(["--tp 2 --pp 2"], world=2)
    with pytest.raises(UsageError, match=r"vpp\(2\) needs pipeline parallelism"):
        _run_cells(["--pp 2", "--vpp 2"], world=2)  # --vpp alone is pp1: refused, not pp2 from before
    assert _run_cells(["--pp 2 --vpp 1"], world=2) == ["tp1 pp2 dp1"]  # 1: no interleaving
    with pytest.raises(UsageError, match=r"vpp must be a positive integer \(1 = no interleaving\), got 0"):
        _run_cells(["--pp 2 --vpp 0"], world=2)
    assert set(LAYOUT_FLAGS) == {"tp", "pp", "vpp", "cp", "ep", "sp", "fsdp"}


def test_fsdp_is_a_layout_flag_refused_before_any_rank():
    # bare --fsdp is ZeRO-3; it is a layout flag (a cell naming another one turns it off); it keeps dp
    assert _run_cells(["--fsdp", "", "--fsdp optim", "--tp 2 --fsdp optim_grads", "--tp 2", "--fsdp"], world=4) == [
        "tp1 pp1 dp4 fsdp:optim_grads_params", "tp1 pp1 dp4 fsdp:optim_grads_params", "tp1 pp1 dp4 fsdp:optim",
        "tp2 pp1 dp2 fsdp:optim_grads", "tp2 pp1 dp2", "tp1 pp1 dp4 fsdp:optim_grads_params"]
    with pytest.raises(UsageError, match=r"invalid choice: 'zero3' \(choose from 'optim', 'optim_grads', "
                                         r"'optim_grads_params'\)"):
        _cell("--fsdp zero3")
    with pytest.raises(UsageError, match=r"fsdp='optim_grads_params' does not combine with pp\(2\).*drop --pp or --fsdp"):
        _run_cells(["--pp 2 --fsdp"], world=4)
    with pytest.raises(ValueError, match=r"ParallelConfig.fsdp must be one of 'optim', 'optim_grads', "
                                         r"'optim_grads_params' or None, got 'ZeRO-3'"):
        ParallelConfig(fsdp="ZeRO-3")


def test_requested_layout_reads_only_the_layout_flags():
    current = ParallelConfig(tp=2).resolve(2)
    args = SimpleNamespace(tp=None, pp=None, vpp=None, cp=None, ep=None, sp=None, fsdp=None, ranks="1", timeout=5.0,
                           grace=1.0)
    assert requested_layout(current, args, 2) == current


def test_rank_lists():
    assert parse_ranks("0,2-3", 4) == [0, 2, 3] and parse_ranks(None, 4) is None and parse_ranks("", 4) is None
    for bad in ("a", "3-1", "-1", ","):
        with pytest.raises(UsageError, match=f"--ranks {bad}: bad rank"):
            parse_ranks(bad, 4)
    # the range rule is the pool's own (mnb.fields.check_ranks), with the flag in front
    with pytest.raises(UsageError, match=r"^--debug-ranks 1-4: rank\(s\) \[4\] not in this pool of world size 4 "
                                         r"\(valid: 0-3\)$"):
        parse_ranks("1-4", 4, "--debug-ranks")


@pytest.mark.parametrize("magic, line, message", [
    ("cell", "--timeout 0", "argument --timeout: must be a positive number, got '0'"),
    ("cell", "--grace -1", "argument --grace: must be a number, zero or positive, got '-1'"),
    ("cell", "--timeout soon", "argument --timeout: must be a positive number, got 'soon'"),
    ("line", "start --grace -1", "argument --grace: must be a number, zero or positive, got '-1'"),
    ("line", "start -n 0", "argument -n: must be a positive integer, got '0'"),
    ("line", "run --timeout 0 x.py", "argument --timeout: must be a positive number, got '0'"),
    ("line", "plan --model tiny --gpus 0", "argument --gpus: must be a positive integer, got '0'"),
    ("line", "export --model tiny --lr 0", "argument --lr: must be a positive number, got '0'"),
    ("line", "start 2 --device cpu", "%mnb start takes the number of ranks as a flag: %mnb start -n 2 --device cpu"),
    ("line", "start -n 2 --ip 10.255.255.1", "--ip 10.255.255.1: the controller cannot listen there (Cannot assign "
     "requested address); use 127.0.0.1 (ranks on this host), 0.0.0.0 (every interface) or an address of this host"),
])
def test_a_bad_number_names_the_flag_the_rule_and_the_value(magic, line, message):
    """Refused while parsing, before any pool is looked up or started (no function name of mnb's in it)."""
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    with pytest.raises(UsageError) as raised:
        if magic == "cell":
            shell.run_cell_magic("megatron", line, "x = 1")
        else:
            shell.run_line_magic("mnb", line)
    assert str(raised.value) == message
    from mnb.controller import current_pool

    assert current_pool(required=False) is None


@pytest.mark.parametrize("magic, line", [("line", "stacks"), ("line", "debug"), ("line", "debug 1"),
                                         ("line", "run train.py"), ("cell", "--tp 2")])
def test_a_command_that_needs_a_pool_says_how_to_start_one(magic, line):
    """Each command is handed the pool (None when none runs); every one that needs a pool refuses the
    same way, as a usage error (%mnb stacks and %mnb debug raised PoolError)."""
    from mnb.controller import current_pool

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    assert current_pool(required=False) is None
    with pytest.raises(UsageError) as raised:
        if magic == "cell":
            shell.run_cell_magic("megatron", line, "x = 1")
        else:
            shell.run_line_magic("mnb", line)
    assert str(raised.value) == "no pool is running; start one with %mnb start"


@pytest.mark.slow
def test_magics_end_to_end(shell, capsys):
    with pytest.raises(UsageError, match="no pool is running"):
        shell.run_cell_magic("megatron", "", "x = 1")
    with pytest.raises(UsageError, match="no GPU is visible here.*use --device cpu"):
        shell.run_line_magic("mnb", "start -n 3 --device cuda")
    with pytest.raises(UsageError, match=r"unknown GPU id\(s\) \[7\]"):
        shell.run_line_magic("mnb", "start --gpus 7")

    with pytest.raises(UsageError, match="--calibrate measures the live pool"):
        shell.run_line_magic("mnb", "plan --model tiny --gpus 2 --calibrate")
    shell.run_line_magic("mnb", "start -n 2 --device cpu --standby off")
    out = capsys.readouterr().out
    assert "rank  pid" in out and "gloo" in out and "2 ranks ready" in out
    assert "(launched cold, standby off)" in out and "; standby off" in out

    # %mnb plan --calibrate measures the CPU ranks (GEMM rates, copy and all-reduce bandwidth) and plans with it
    from mnb.estimate import hardware

    shell.run_line_magic("mnb", "plan --model tiny --gpus 2 --calibrate --top 3")
    out = capsys.readouterr().out
    measured = hardware.DEVICES.pop("cpu-calibrated")
    assert "(calibrated here)" in out and "GEMM efficiency by effective size" in out and "tp1 pp1 dp2" in out
    assert max(f for _, f in measured.gemm_curve) == 1.0 and measured.bf16_flops > 0  # the best rate is the peak
    assert "--calibrate on cpu (2 rank(s)" in measured.source_of("intra_efficiency")
    assert measured.hbm_bytes_per_s != hardware.DEVICES["cpu"].hbm_bytes_per_s

    shell.run_cell_magic("megatron", "--tp 2", "print('tp size', ps.get_tensor_model_parallel_world_size())")
    assert "[r0-1] tp size 2" in capsys.readouterr().out

    # A cell without layout flags keeps the layout (tp=2).  Names persist between cells.
    shell.run_cell_magic("megatron", "", "y = ps.get_tensor_model_parallel_rank()")
    shell.run_cell_magic("megatron", "", "print('y', y, 'world', world_size, 'dp', ps.get_data_parallel_world_size())")
    out = capsys.readouterr().out
    assert "[r0 tp0 pp0 dp0] y 0 world 2 dp 1" in out and "[r1 tp1 pp0 dp0] y 1 world 2 dp 1" in out

    # A cell naming a layout flag gets exactly that layout: --pp 2 after --tp 2 is tp1 pp2 on 2 ranks.
    sizes = "print('sizes', ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())"
    shell.run_cell_magic("megatron", "--pp 2", sizes)
    shell.run_cell_magic("megatron", "", sizes)
    out = capsys.readouterr().out
    assert out.count("[r0-1] sizes 1 2") == 2 and "sizes 2" not in out, out
    shell.run_cell_magic("megatron", "--tp 2  # a trailing comment is ignored", sizes)
    assert "sizes 2 1" in capsys.readouterr().out

    with pytest.raises(UsageError, match=r"tp\(2\) \* pp\(2\) \* cp\(1\) = 4 does not divide world size 2"):
        shell.run_cell_magic("megatron", "--tp 2 --pp 2", "pass")
    with pytest.raises(UsageError, match=r"--ranks 0,5: rank\(s\) \[5\] not in this pool of world size 2"):
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
    assert "idle" in out and "layout: tp2 pp1 dp1; 2 x cpu ranks, running\n" in out and "torchrun.log" in out
    assert out.count("tp2 pp1 dp1") == 1  # the layout once (it was also inside the pool's repr)
    assert "versions: torch " in out and ", megatron-core " in out  # the ranks' own, from their hello
    assert "standby: none (off)" in out

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


def test_load_ext_binds_mnb_and_registers_once(shell):
    import mnb

    assert shell.user_ns["mnb"] is mnb
    shell.run_line_magic("reload_ext", "mnb")  # loading again: the same magics, one input transformer
    from mnb.notebook.magics import help_end_transformer

    assert shell.input_transformers_cleanup.count(help_end_transformer) == 1


FIRST_TRAINING_CELL = (
    "import os, tempfile\n"
    "model = mnb.gpt('tiny')\n"
    "mnb.train(model, steps=1, micro_batch_size=2, global_batch_size=4, lr=1e-3)\n"
    "ckpt = [tempfile.mkdtemp(prefix='mnb-warn-') + '/ckpt']\n"
    "dist.broadcast_object_list(ckpt, 0)\n"
    "mnb.save(ckpt[0], model)\n"
    "mnb.load(ckpt[0], model)\n"
    # fp32 with the distributed optimizer: Megatron zeroes .grad of its shard views (torch's non-leaf notice)
    "mnb.train(mnb.gpt('tiny'), steps=1, micro_batch_size=2, global_batch_size=4, use_distributed_optimizer=True)\n"
)


def _first_training_cell_output(shell, capsys, start_flags: str) -> tuple[str, str]:
    shell.run_line_magic("mnb", f"start -n 2 --device cpu {start_flags}")
    pool = __import__("mnb").pool()
    pids = pool.pids()
    capsys.readouterr()
    try:
        # tp2 with sequence parallelism: its collectives raise torch's deprecation notices too
        shell.run_cell_magic("megatron", "--tp 2 --sp", FIRST_TRAINING_CELL)
        captured = capsys.readouterr()
        run = __import__("mnb").last_run
        # the cell trained (so "no warning in the cell" is about a cell that did the work)
        assert run.steps == [1] and run.losses[0] is not None and run.losses[0] > 0, run
        log = pool.spec.log_file.read_text()
    finally:
        shell.run_line_magic("mnb", "stop")
        assert_no_orphans(pids)
    return captured.out + captured.err, log


@pytest.mark.slow
def test_known_third_party_warnings_go_to_the_pool_log_not_the_cell(shell, capsys):
    """Megatron's import notices and torch's checkpoint warnings: in the log, not in the first training cell."""
    out, log = _first_training_cell_output(shell, capsys, "")
    assert "Warning" not in out, out  # neither UserWarning nor FutureWarning
    assert "UserWarning" in log and "to the log" in log, log[-3000:]  # e.g. "full scope is deprecated"
    assert "not a leaf Tensor" in log, log[-3000:]  # Megatron's optimizer's, routed (the user's own would show)


@pytest.mark.slow
def test_verbose_start_shows_the_warnings_in_the_cell(shell, capsys):
    out, _ = _first_training_cell_output(shell, capsys, "--verbose")
    assert "UserWarning" in out and "[r0-1]" in out, out


def _rendered(shell, code: str, capsys) -> tuple[BaseException | None, list[str]]:
    """Run a cell as a notebook does; the lines IPython showed for its error (stdout and stderr)."""
    capsys.readouterr()
    result = shell.run_cell(code)
    captured = capsys.readouterr()
    return result.error_in_exec, (captured.out + captured.err).strip().splitlines()


@pytest.fixture
def started(shell):
    """The session's 2-rank pool (tests/conftest.py) as the shell's current pool, for this test."""
    from mnb.controller.registry import current_pool, set_current_pool
    from tests.shared_pools import reset_pool, shared_pool

    before = current_pool(required=False)  # one an earlier test left: the module's `%mnb stop` ends it
    pool = reset_pool(shared_pool(2, timeout=180))
    set_current_pool(pool)
    yield pool
    set_current_pool(before)


@pytest.mark.slow
def test_pool_errors_render_short_in_a_notebook(shell, started, capsys, tmp_path):
    pool = started
    release = tmp_path / "release"  # the holder's cell runs until the refused cell was tried
    holder = threading.Thread(target=lambda: pool.run(
        f"import os, time\nwhile not os.path.exists({str(release)!r}):\n    time.sleep(0.02)", quiet=True, timeout=300))
    holder.start()
    deadline = time.monotonic() + 120
    while not pool._gate.holder and time.monotonic() < deadline:  # the holder's request has the pool
        holder.join(0.02)
    try:
        error, busy = _rendered(shell, "%%megatron\nprint('never runs')", capsys)
    finally:
        release.touch()
        holder.join()
    assert type(error).__name__ == "PoolError" and "busy" in busy[0] and len(busy) <= 6, busy

    error, refused = _rendered(shell, "%%megatron --tp 2\nmodel = mnb.gpt('tiny', num_attention_heads=3, "
                                      "hidden_size=96, num_query_groups=3)", capsys)
    assert isinstance(error, UsageError) and "refused" in refused[0] and len(refused) <= 6, refused
    error, layout = _rendered(shell, "%%megatron --tp 3\npass", capsys)
    assert isinstance(error, UsageError) and "does not divide" in layout[0] and len(layout) <= 6, layout
    # an interrupted cell's short error: tests/controller/test_recovery.py's print-loop test, through a real kernel


@pytest.mark.slow
def test_a_timed_out_cell_renders_short(shell, started, capsys):
    error, lines = _rendered(shell, "%%megatron --timeout 2\nimport time\ntime.sleep(30)", capsys)
    assert type(error).__name__ == "CellTimeoutError" and "timed out" in lines[0]
    assert len(lines) <= 6, lines


@pytest.mark.slow
def test_a_refused_push_renders_short(shell, started, capsys):
    error, lines = _rendered(shell, "mnb.pool().push({'f': lambda: 1})", capsys)
    assert isinstance(error, TypeError) and "nothing was sent" in "\n".join(lines)
    assert len(lines) <= 6, lines
