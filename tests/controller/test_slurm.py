"""A pool on a real Slurm: Debian's slurm-wlm + munge on localhost (tests/slurm_local.py), no mocks.

Two nodes, two ``slurmd`` on this host (n1, n2), each with 2 CPUs and 2 GPU "slots".  The
pool's job runs one torchrun per node, whose CPU ranks join the notebook like hand-joined
ranks do; the tests then check a tp2 cell across both nodes, the automatic restart (a
new job) and that the job is gone after ``%mnb stop``, that a job pending at ``--timeout`` is cancelled with
Slurm's reason, that a killed kernel's job is cancelled by its watcher, and that the
sbatch script of ``%mnb export slurm`` passes ``sbatch --test-only``.  Skipped, with
the reason, where Slurm is not installed (scripts/setup.sh installs it) or not root.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell

from mnb.controller import Pool
from mnb.controller.slurm import SlurmRequest, job_state
from mnb.errors import PoolError, RankDiedError
from mnb.megatron_lm.exports import export
from tests.conftest import assert_no_orphans
from tests.slurm_local import LocalSlurm, unavailable

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    cluster = LocalSlurm(root, cpus=2, gpus=2, nodes=2).start()
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "MNB_SLURM_DIR")}
    os.environ.update(cluster.env, MNB_SLURM_DIR=str(root / "pools"))
    try:
        yield cluster
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        cluster.stop()


def queued(job_id: str) -> str:
    """What squeue lists for the job: empty once it is no longer pending, running or completing."""
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def _job(pool) -> str:
    return re.search(r"Slurm job (\d+)", pool.launch_description())[1]


def test_a_pool_across_two_slurm_nodes_runs_a_tp2_cell_restarts_itself_and_stop_cancels_its_jobs(slurm, capsys):
    """The pool's job spans both slurmd "nodes": one torchrun agent each, one rank each, a c10d
    rendezvous on the first node's NodeAddr; a tp2 all-reduce crosses the nodes; a rank that dies
    brings the automatic restart (a new job, the old one cancelled); %mnb stop cancels the last."""
    from mnb.controller import current_pool

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    # --ip 0.0.0.0 as on a cluster: the connection file names this host, not the wildcard
    shell.run_line_magic("mnb", "start --slurm --nodes 2 --ntasks-per-node 1 --device cpu --timeout 180 "
                                "--ip 0.0.0.0")
    out = capsys.readouterr().out
    job = re.search(r"submitted Slurm job (\d+)", out)[1]
    assert "2 node(s) x 1 cpu rank(s)" in out and "(loopback)" not in out and "2 ranks ready" in out, out
    shell.run_line_magic("mnb", "status")
    status = capsys.readouterr().out
    assert f"Slurm job {job}: RUNNING on n[1-2]" in status, status
    code = ("import os\nt = torch.tensor([float(rank + 1)])\n"
            "dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())\n"
            "print('tp', ps.get_tensor_model_parallel_world_size(), int(t.item()), os.environ['SLURM_JOB_ID'], "
            "os.environ['SLURMD_NODENAME'], os.environ['SLURM_NNODES'])")
    shell.run_cell_magic("megatron", "--tp 2", code)
    cell = capsys.readouterr().out
    assert cell.count(f"tp 2 3 {job}") == 2, cell  # 1 + 2 summed over the tp group that spans the nodes
    assert f"{job} n1 2" in cell and f"{job} n2 2" in cell, cell  # one rank on each node
    shell.run_line_magic("mnb", "export --model tiny")  # the pool's layout and world size
    exported = capsys.readouterr().out
    assert "--tensor-model-parallel-size 2 \\" in exported, exported

    pool = current_pool()
    restarts = pool.restarts
    with pytest.raises(RankDiedError, match="restarting all 2 ranks"):  # rank 1 (one node) dies: its job ends
        shell.run_cell_magic("megatron", "", "import os\nif rank == 1:\n    os._exit(3)\ndist.barrier()")
    capsys.readouterr()
    assert pool.run("rank * 2") == {0: 0, 1: 2}  # waits for the automatic restart: a new job
    assert pool.restarts == restarts + 1
    new_job = _job(pool)
    assert new_job != job and queued(job) == "" and queued(new_job) == "RUNNING"
    assert pool.run("ps.get_tensor_model_parallel_world_size()") == {0: 2, 1: 2}  # the layout stayed
    pids = pool.pids()
    workdir = pool.workdir()
    assert json.loads((workdir / "pool.json").read_text())["address"].startswith(f"tcp://{socket.gethostname()}:")
    shell.run_line_magic("mnb", "stop")
    assert queued(new_job) == "" and not job_state(new_job).active
    assert not workdir.exists()  # the connection file (the pool's secret) went with it
    assert_no_orphans(pids)


def test_a_job_still_pending_at_the_timeout_is_cancelled_with_slurms_reason(slurm, capsys):
    with pytest.raises(PoolError) as err:
        Pool.start(2, device="cpu", timeout=3, slurm=SlurmRequest(sbatch_args=("--begin=now+1hour",)))
    assert "listens on 127.0.0.1 (loopback): only ranks on this host" in capsys.readouterr().out
    text = str(err.value)
    assert "still pending after 3 s" in text and "Slurm's reason: BeginTime" in text and "cancelled" in text
    job = re.search(r"Slurm job (\d+)", text)[1]
    assert queued(job) == ""


def test_slurm_refusing_the_job_says_what_to_change(slurm):
    with pytest.raises(PoolError, match="invalid partition specified: nowhere"):
        Pool.start(2, device="cpu", timeout=30, slurm=SlurmRequest(partition="nowhere"))


def test_a_killed_kernel_has_its_queued_job_cancelled(slurm):
    code = ("from mnb.controller import Pool\nfrom mnb.controller.slurm import SlurmRequest\n"
            "Pool.start(2, device='cpu', timeout=600, slurm=SlurmRequest(sbatch_args=('--hold',)))\n")
    kernel = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        job = None
        for line in kernel.stdout:
            match = re.search(r"submitted Slurm job (\d+)", line)
            if match:
                job = match[1]
                break
        assert job and queued(job) == "PENDING"
        os.kill(kernel.pid, signal.SIGKILL)  # no atexit, no stop(): only the watcher is left to act
        kernel.wait(timeout=10)
        deadline = time.monotonic() + 20
        while queued(job) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert queued(job) == "", f"job {job} outlived its kernel"
    finally:
        if kernel.poll() is None:
            kernel.kill()


def test_the_exported_sbatch_script_passes_sbatch_test_only(slurm, tmp_path):
    ok = export("slurm", model="tiny", nodes=1, gpus_per_node=2, output=tmp_path / "ok.sbatch")
    too_big = export("slurm", model="tiny", nodes=1, gpus_per_node=4, output=tmp_path / "big.sbatch")
    assert ok.layout.dp == 2 and too_big.layout.dp == 4
    accepted = subprocess.run(["sbatch", "--test-only", str(tmp_path / "ok.sbatch")], capture_output=True, text=True)
    assert accepted.returncode == 0 and "to start at" in accepted.stderr, accepted.stderr
    refused = subprocess.run(["sbatch", "--test-only", str(tmp_path / "big.sbatch")], capture_output=True, text=True)
    assert refused.returncode != 0  # the local node has 2 GPU slots: Slurm really checks the request
