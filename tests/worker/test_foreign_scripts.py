"""Other people's GPU torchrun scripts, unchanged, under ``%mnb run`` on a 2-rank CPU pool.

The scripts in tests/scripts/{ddp_trainer,nanogpt,gated,checkpoint,accel} are written
as well-known tutorials and trainers are (for ``torchrun`` on GPUs: nccl, ``.to(gpu_id)``,
``device = f"cuda:{local_rank}"``, DDP ``device_ids``, autocast, GradScaler, pinned
batches, ``map_location``, a ``device_count()`` gate, accelerate's ``PartialState``).
Each runs twice in one pool, in two orders, and prints the losses a fresh torchrun of
the same script prints (``torchrun -m mnb.megatron.cpurun``, started by the test).  The
notebook-facing part (``%cd``, ``%env``, output of child processes) runs in a real
Jupyter kernel.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.kernel_client import Kernel

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
LOSS = re.compile(r"rank (\d+) (?:step|iter|Epoch) ?(\d+)\D.*?loss ([-\d.e]+)|\[GPU(\d+)\] Epoch (\d+) .*?loss ([-\d.e]+)")

RUNS = {  # name: (script, arguments, what the one "ran on the CPU" line names)
    "nanogpt": ("nanogpt/train.py", [], ["torch.cuda.is_available", "torch.cuda.is_bf16_supported",
                                         "autocast(cuda)", "GradScaler(cuda)", "pin_memory()", "DDP(device_ids)",
                                         "module.to(cuda)", "tensor.to(cuda)", "torch.cuda.max_memory_allocated"]),
    "ddp_trainer": ("ddp_trainer/multigpu_torchrun.py", ["2", "1"],
                    ["torch.cuda.set_device", "torch.cuda.Event", "torch.cuda.synchronize",
                     "torch.cuda.get_device_name"]),
    "gated": ("gated/two_gpus.py", [], ["torch.cuda.device_count", "torch.device('cuda')", "module.cuda()",
                                       "torch.cuda.amp.autocast", "torch.cuda.empty_cache",
                                       "torch.cuda.manual_seed_all"]),
    "checkpoint": ("checkpoint/save_resume.py", ["--ckpt", "ckpt.pt"],
                   ["torch.load(map_location=cuda)", "storage.cuda()", "device='cuda' in factories"]),
    "accel": ("accel/accel_state.py", [], ["accelerate PartialState(cpu=True)"]),
    "megatron": ("mcore_train.py", ["--tp", "2", "--steps", "2", "--microbatches", "2", "--ckpt", "mcore_ckpt"], []),
}


def losses(text: str) -> list[tuple]:
    """The (rank, step, loss) a script printed, sorted; Megatron's "step N: loss X" as rank -1."""
    found = {tuple(x for x in m.groups() if x is not None) for m in LOSS.finditer(text)}
    found |= {("-1", s, v) for s, v in re.findall(r"step (\d+): loss ([\d.]+)", text)}
    return sorted(found)


def workdir(path: Path) -> Path:
    """A folder to run the scripts from: nanoGPT's configurator.py and data/train.bin."""
    (path / "data").mkdir(parents=True)
    np.random.default_rng(0).integers(0, 64, 2000).astype(np.uint16).tofile(path / "data" / "train.bin")
    (path / "configurator.py").write_text("max_iters = 3\nn_layer = 1\n")
    return path


def fresh_runs(cwd: Path, out: dict[str, str]) -> None:
    """Each script in a fresh ``torchrun --nproc-per-node 2 -m mnb.megatron.cpurun`` (one after another)."""
    for name, (script, args, _) in RUNS.items():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "mnb.megatron.cpurun", str(SCRIPTS / script), *args]
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
        out[name] = done.stdout + (f"\nexit {done.returncode}: {done.stderr[-3000:]}" if done.returncode else "")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    out: dict[str, str] = {}
    thread = threading.Thread(target=fresh_runs, args=(workdir(tmp_path_factory.mktemp("fresh")), out))
    thread.start()
    yield lambda: (thread.join(), out)[1]
    thread.join()


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = Kernel()
    here = workdir(tmp_path_factory.mktemp("notebook"))
    k.ok("%load_ext mnb\nimport mnb, os, shutil, sys\nos.environ['GONE26'] = 'x'")  # the ranks inherit it
    k.ok("%mnb start -n 2 --device cpu")
    k.ok(f"%cd {here}")
    k.here = here
    try:
        yield k
    finally:
        k.ok("%mnb stop")
        k.shutdown()


def run(kernel: Kernel, name: str) -> str:
    script, args, _ = RUNS[name]
    return kernel.ok(f"%mnb run {SCRIPTS / script} {' '.join(args)}", timeout=600)


def test_gpu_scripts_run_unchanged_twice_in_any_order_as_fresh_processes(kernel, fresh):
    names = list(RUNS)
    first = {name: run(kernel, name) for name in names}
    kernel.ok("shutil.rmtree('mcore_ckpt')")  # Megatron's checkpoint wants an empty folder
    # A library singleton from a cell: accelerate's state, made outside a script (one process of one).
    assert "DistributedType.NO" in kernel.ok("%%megatron\nfrom accelerate import PartialState\n"
                                             "print(PartialState().distributed_type)")
    second = {name: run(kernel, name) for name in reversed(names)}
    reference = fresh()
    for name in names:
        expected = losses(reference[name])
        assert len(expected) >= 2, (name, reference[name])
        assert losses(first[name]) == expected, (name, first[name], reference[name])
        assert losses(second[name]) == expected, (name, second[name])
        ran_on_cpu = [line for line in first[name].splitlines() if "GPU calls that ran on the CPU" in line]
        assert len(ran_on_cpu) <= 1 and all(idiom in "".join(ran_on_cpu) for idiom in RUNS[name][2]), (name, ran_on_cpu)
    assert "iter 2: loss" in first["nanogpt"] and "iter 3:" not in first["nanogpt"]  # ./configurator.py read
    assert "Unable to locate" not in first["gated"] + second["gated"]
    assert "the three loads agree: True" in first["checkpoint"]
    assert "process 1 of 2: DistributedType.MULTI_CPU" in second["accel"]
    assert "checkpoint reloaded identical: True; tp 2" in first["megatron"]
    # A child process's output (subprocess.run(["echo", ...])) is in the cell, labelled, and in the pool log.
    assert re.search(r"\[r1 [^\]]*\] echo from rank 1", first["ddp_trainer"]), first["ddp_trainer"]
    log = Path(kernel.value("str(mnb.pool().spec.log_file)")).read_text(errors="replace")
    assert "echo from rank 0" in log and "echo from rank 1" in log
    # Two folders' model.py were both found; neither is left in the ranks' sys.modules.
    assert "False False" in kernel.ok("%%megatron\nprint('model' in sys.modules, 'configurator' in sys.modules)")


EDITABLE = """
import os, subprocess, sys
import torch
from helper import VALUE
device = "cuda:0"
os.environ["SET_BY_SCRIPT"] = "1"
print(f"value {VALUE} cwd {os.getcwd()} flag {os.environ.get('FOO26_FLAG')} gone {'GONE26' in os.environ}")
subprocess.run([sys.executable, "-c", "import sys; print('child stderr', file=sys.stderr)"])
"""


def test_sandbox_cwd_environment_edited_modules_names_and_clear_errors(kernel, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "go.py").write_text(EDITABLE)
    (folder / "helper.py").write_text("VALUE = 1\n")
    (folder / "stream.py").write_text("import torch\ntorch.cuda.Stream()\n")
    kernel.ok("%%megatron\nimport os, sys")
    kernel.ok(f"%cd {folder}\n%env FOO26_FLAG=on\ndel os.environ['GONE26']")
    text = kernel.ok("%mnb run go.py")
    assert f"value 1 cwd {folder} flag on gone False" in text
    assert "child stderr" in text  # a child's stderr reaches the cell too
    assert "mnb's names are mnb's again after the script: device (the script's: 'cuda:0')" in text
    (folder / "helper.py").write_text("VALUE = 22  # edited\n")
    assert "value 22" in kernel.ok("%mnb run go.py")
    after = kernel.ok("%%megatron\nprint(device, os.getcwd(), os.environ.get('FOO26_FLAG'), "
                      "'SET_BY_SCRIPT' in os.environ, 'helper' in sys.modules)")
    assert after.count(f"cpu {folder} on False False") == 1, after  # cells follow %cd too
    failed = kernel.execute("%mnb run stream.py")
    rendered = "\n".join(failed.error["traceback"]) if failed.error else ""
    assert "torch.cuda.Stream: CUDA streams" in rendered and "GPU pool" in rendered, rendered
    kernel.ok("%%megatron\nassert dist.get_world_size() == 2")  # the pool is usable after the failure
    kernel.ok(f"%cd {kernel.here}")


def test_isolated_runs_in_fresh_processes_and_keeps_the_layout(kernel, tmp_path):
    (tmp_path / "pid.py").write_text("import os\nprint('script pid', os.getpid())\n")
    kernel.ok("%%megatron --tp 2\npass")
    before = kernel.value("sorted(mnb.pool().pids())")
    text = kernel.ok(f"%mnb run --isolated {tmp_path / 'pid.py'}", timeout=600)
    assert "--isolated: fresh rank processes for the script (2 ranks restarted in" in text
    assert "the pool restarted after the script in" in text
    pids = {int(p) for p in re.findall(r"script pid (\d+)", text)}
    after = kernel.value("sorted(mnb.pool().pids())")
    assert len(pids) == 2 and not pids & set(before) and not pids & set(after)
    assert kernel.value("mnb.pool().layout.tp") == 2
    kernel.ok("%%megatron --tp 1\npass")
