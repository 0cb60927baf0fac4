"""``%mnb run`` / ``pool.run_script`` with real torchrun scripts, and your own loop and step, measured.

One 2-rank CPU pool for the module.  The scripts in tests/scripts/ are written for
``torchrun --nproc-per-node 2`` on GPUs (nccl, set_device, .cuda()) and run here
unmodified.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

import pytest
from IPython.core.error import UsageError

import mnb
from mnb.config import ParallelConfig
from mnb.errors import CompositeRankError

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _ddp(pool, out: Path) -> list[dict]:
    pool.run_script(SCRIPTS / "ddp_torchrun.py", ["--steps", "4", "--out", str(out)])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_torch_ddp_script_runs_unmodified_as_under_torchrun_twice(cpu_pool, tmp_path, capsys):
    pids = {r: i.pid for r, i in cpu_pool.ranks.items()}
    first = _ddp(cpu_pool, tmp_path / "a")
    out = capsys.readouterr().out
    assert "[r0 tp0 pp0 dp0] rank 0: loss" in out and "[r1 tp0 pp0 dp1] rank 1: loss" in out
    script = str(SCRIPTS / "ddp_torchrun.py")
    for r, seen in enumerate(first):
        assert (seen["rank"], seen["world_size"], seen["local_world_size"]) == (r, 2, "2")
        assert seen["argv"] == [script, "--steps", "4", "--out", str(tmp_path / "a")]
        assert (seen["name"], seen["file"], seen["path0"]) == ("__main__", script, str(SCRIPTS))
        assert seen["master"][0] and seen["master"][1]
    assert first[0]["checksum"] == pytest.approx(first[1]["checksum"], rel=1e-12)  # DDP kept replicas equal
    assert first[0]["losses"] != first[1]["losses"]  # ... while each rank saw its own data
    second = _ddp(cpu_pool, tmp_path / "b")
    assert [s["losses"] for s in second] == [s["losses"] for s in first]  # a fresh run, the same result
    # The script's globals stay for later cells; torch there is the real module, the group the pool's.
    assert cpu_pool.run("callable(main) and callable(parse_args) and torch.__name__ == 'torch' "
                        "and dist.is_initialized() and dist.get_world_size()") == {0: 2, 1: 2}
    assert {r: i.pid for r, i in cpu_pool.ranks.items()} == pids
    assert not cpu_pool.last_cell_records  # no Megatron schedule ran: no run record


def test_megatron_script_trains_saves_loads_and_is_measured(cpu_pool, tmp_path, capsys):
    """Megatron-LM-example style on tp2 (the pool runs tp1 dp2), twice; the pool's layout comes back."""
    args = ["--tp", "2", "--steps", "3", "--microbatches", "2"]
    losses = []
    for attempt in ("a", "b"):
        cpu_pool.run_script(SCRIPTS / "mcore_train.py", [*args, "--ckpt", str(tmp_path / attempt)])
        assert "[r0-1] checkpoint reloaded identical: True; tp 2" in capsys.readouterr().out
        losses.append(cpu_pool.pull("losses")[0])
        run = mnb.last_run
        assert (run.layout.tp, run.layout.dp, run.num_microbatches, len(run.steps)) == (2, 1, 2, 3)
        assert run.losses == pytest.approx(losses[-1])  # what the script's loss_func reported
        assert run.model.name == "GPTModel" and run.model.num_layers == 2 and run.model_flops_per_step > 0
        kinds = [(e["kind"], e["microbatch"]) for e in run.timeline() if e["kind"] in ("forward", "backward")]
        assert kinds == [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)]
        assert all(e["end_s"] >= e["start_s"] >= 0 for e in run.timeline())
        for counted in run.measured_memory.values():
            assert min(counted["weights"], counted["gradients"], counted["optimizer"], counted["activations"]) > 0
        assert all(t and t > 0 for t in run.step_times_s) and run.mfu[-1] > 0
    assert losses[0] == losses[1]
    assert cpu_pool.layout == ParallelConfig().resolve(2)
    assert cpu_pool.run("(ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size())") == \
        {0: (1, 2), 1: (1, 2)}


def test_exit_codes_and_the_failure_of_one_rank_then_a_cell_runs(shell, cpu_pool, capsys):
    pids = {r: i.pid for r, i in cpu_pool.ranks.items()}
    shell.run_line_magic("mnb", f"run {SCRIPTS / 'exit_code.py'} 0 --flag")
    out = capsys.readouterr().out
    # both ranks got the arguments: one folded line, or (lines more than the folding window apart on a
    # loaded machine) one per rank; folding itself is tests/controller/test_output.py's
    assert "[r0-1] args ['0', '--flag']" in out or (
        "[r0 tp0 pp0 dp0] args ['0', '--flag']" in out and "[r1 tp0 pp0 dp1] args ['0', '--flag']" in out), out
    with pytest.raises(CompositeRankError, match="the script exited with code 3"):
        cpu_pool.run_script(SCRIPTS / "exit_code.py", ["3"])
    with pytest.raises(CompositeRankError) as info:
        cpu_pool.run_script(SCRIPTS / "fail_one_rank.py")
    assert info.value.ranks == [1]
    rendered = "\n".join(info.value._render_traceback_())
    assert "RuntimeError: bad shard on rank 1" in rendered and "fail_one_rank.py" in rendered
    assert "[r1 tp0 pp0 dp1]" in rendered  # labelled by the pool's coordinates
    shell.run_cell_magic("megatron", "--tp 2", "print('tp', ps.get_tensor_model_parallel_world_size(), rank)")
    out = capsys.readouterr().out
    assert "tp 2 0" in out and "tp 2 1" in out
    assert {r: i.pid for r, i in cpu_pool.ranks.items()} == pids  # the same processes throughout
    shell.run_cell_magic("megatron", "", "pass")
    assert cpu_pool.layout.tp == 2
    shell.run_cell_magic("megatron", "--tp 1", "pass")


def test_cells_run_where_the_notebook_is_and_a_missing_path_names_that_folder(shell, cpu_pool, tmp_path, capsys):
    folder = Path(os.path.realpath(tmp_path))
    (folder / "notes.txt").write_text("read by a relative path\n")
    here = os.getcwd()
    try:
        shell.run_line_magic("cd", str(folder))
        capsys.readouterr()
        shell.run_cell_magic("megatron", "", "print(open('notes.txt').read().strip(), 'on rank', rank)")
        out = capsys.readouterr().out
        assert "read by a relative path on rank 0" in out and "read by a relative path on rank 1" in out, out
        with pytest.raises(CompositeRankError) as info:
            shell.run_cell_magic("megatron", "", "mnb.from_hf('tiny-llama')")
        assert f"tiny-llama does not exist (relative paths start in {folder})" in str(info.value), str(info.value)
    finally:
        os.chdir(here)
    # A host of the pool without the notebook's folder: its ranks stay where they are and say so once.
    gone = str(folder / "not-on-this-host")
    said = (f"the notebook's directory {gone} does not exist on {socket.gethostname()}: this host's ranks stay "
            f"in {folder}, where their relative paths start (said once)")
    outs = []
    for _ in range(2):
        cpu_pool.run("import os\nprint('cwd:', os.getcwd())", kernel={"cwd": gone})
        outs.append(capsys.readouterr().out)
        cpu_pool.run("pass")  # a request without the kernel's context between them changes nothing
    assert said in outs[0] and f"cwd: {folder}" in outs[0], outs[0]
    assert "does not exist" not in outs[1] and f"cwd: {folder}" in outs[1], outs[1]


def test_clear_early_errors(shell, cpu_pool):
    with pytest.raises(UsageError, match="no script 'no_such_script.py'"):
        shell.run_line_magic("mnb", "run no_such_script.py")
    with pytest.raises(CompositeRankError, match=r"needs every rank of the pool \(2\), but it runs on rank\(s\) "
                                                 r"\[0\] only \(--ranks\): drop --ranks"):
        shell.run_line_magic("mnb", f"run --ranks 0 --timeout 60 {SCRIPTS / 'fail_one_rank.py'}")
    help_text = shell.run_line_magic("mnb", "run --help")
    assert help_text is None


OWN_LOOP = """
from functools import partial
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, pipeline_dtype=torch.float32)
gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
               max_sequence_length=16)
g = torch.Generator().manual_seed(rank)

def batches():
    while True:
        tokens = torch.randint(0, 128, (2, 16), generator=g)
        yield {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "position_ids": torch.arange(16).expand(2, 16)}

def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}
    return output, loss_func
"""

LOOP = """
ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), gpt)
config.finalize_model_grads_func = finalize_model_grads
optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [ddp])
forward_backward = get_forward_backward_func()
data = batches()
for step in range(3):
    ddp.zero_grad_buffer(); optimizer.zero_grad()
    forward_backward(forward_step_func=forward_step, data_iterator=data, model=[ddp], num_microbatches=2,
                     seq_length=16, micro_batch_size=2, forward_only=False)
    optimizer.step()
"""


def test_own_loop_in_a_cell_is_measured_and_record_false_turns_it_off(shell, cpu_pool):
    cpu_pool.run(OWN_LOOP + LOOP, quiet=True)
    run = mnb.last_run
    assert run.layout.dp == 2 and len(run.steps) == 3 and all(x is not None for x in run.losses)
    assert {e["kind"] for e in run.timeline()} >= {"forward", "backward", "optimizer"}
    assert len([e for e in run.timeline() if e["kind"] == "forward"]) == 2
    memory = run.measured_memory[0]
    assert memory["optimizer"] > 0 and memory["activations"] > 0 and memory["peak"] > memory["weights"]
    assert run.train.lr == pytest.approx(1e-3)
    shell.run_line_magic("mnb", "plot timeline")
    shell.run_line_magic("mnb", "plot memory")
    cpu_pool.run("was = mnb.record(False)\n" + OWN_LOOP + LOOP + "\nmnb.record(True)", quiet=True)
    assert not cpu_pool.last_cell_records and cpu_pool.pull("was") == {0: True, 1: True}


def test_mnb_train_with_your_own_model_and_step(cpu_pool):
    cpu_pool.run(OWN_LOOP + "\nrecord = mnb.train(gpt, forward_step_func=forward_step, data_iterator=batches(), "
                 "steps=2, micro_batch_size=2, global_batch_size=8, lr=1e-3)", quiet=True)
    run = mnb.last_run
    assert (run.model.name, run.num_microbatches, len(run.steps), run.model.seq_length) == ("GPTModel", 2, 2, 16)
    assert all(loss == loss and loss > 0 for loss in run.losses)  # finite: what loss_func reported
    assert run.measured_memory[0]["optimizer"] > 0 and run.timeline()
    cpu_pool.run("record = mnb.train(gpt, forward_step_func=forward_step, data_iterator=batches(), steps=1, "
                 "micro_batch_size=2, global_batch_size=8, lr=1e-3)", quiet=True)
    assert cpu_pool.run("gpt._mnb_model.steps_done") == {0: 3, 1: 3}  # the same DDP and optimizer continued
    with pytest.raises(CompositeRankError, match="pass your forward_step_func"):
        cpu_pool.run("mnb.train(gpt, steps=1)", quiet=True)


PROCESS_SETTINGS = """
import io, logging, signal, sys, warnings
import torch.distributed as dist
warnings.filterwarnings("error")                 # every later warning would raise: mnb.gpt failed
logging.getLogger().setLevel(logging.DEBUG)
sys.setrecursionlimit(200)
signal.signal(signal.SIGINT, signal.SIG_IGN)     # graceful-shutdown code: Kernel -> Interrupt restarted the pool
_real = dist.all_reduce
def traced(*args, **kwargs):
    return _real(*args, **kwargs)
dist.all_reduce = traced
sys.stdout = io.StringIO()                       # every later print vanished
"""


def test_a_scripts_process_settings_are_put_back_and_said(cpu_pool, tmp_path, capsys):
    """What a script sets for the whole process does not outlive it: warnings filters, the root logger, the
    recursion limit, signal handlers, sys.stdout and torch.distributed's functions are put back, one line
    says which, and the next cell builds a model, prints, and stops on an interrupt's signal handler."""
    script = tmp_path / "settings.py"
    script.write_text(PROCESS_SETTINGS)
    capsys.readouterr()
    cpu_pool.run_script(script)
    out = capsys.readouterr().out
    assert ("mnb: put back after the script, as a fresh process would have them: warnings filters, the root "
            "logger, the recursion limit, sys.stdout, the SIGINT handler, torch.distributed.all_reduce") in out, out
    state = cpu_pool.run("import logging, signal, sys, warnings\n"
                         "(warnings.filters[0][0] != 'error', logging.getLogger().level, sys.getrecursionlimit() > 200,"
                         " signal.getsignal(signal.SIGINT) is signal.default_int_handler, dist.all_reduce.__name__)",
                         quiet=True)
    assert set(state.values()) == {(True, logging.WARNING, True, True, "all_reduce")}, state
    capsys.readouterr()
    assert cpu_pool.run("m = mnb.gpt('tiny')\nprint('seen after the script', rank)\nm.config.num_layers",
                        layout=ParallelConfig(tp=2)) == {0: 4, 1: 4}  # tiny has 4 layers
    assert "seen after the script 0" in capsys.readouterr().out
