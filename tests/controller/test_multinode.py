"""Workers started by a second torchrun ("another node") join the notebook's pool.

Both "nodes" run on this machine over loopback: the pool's own torchrun is
node A; the test starts node B by hand with the command a user would run on
another host, pointing at the same connection file.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from mnb.controller import Pool
from mnb.controller.launcher import LaunchSpec
from tests.conftest import assert_no_orphans
from tests.ports import unclaimed_port

pytestmark = pytest.mark.slow


def test_second_torchrun_node_joins_on_loopback(tmp_path):
    endpoint = f"127.0.0.1:{unclaimed_port()}"
    connection = tmp_path / "pool.json"
    node_b: list[subprocess.Popen] = []

    def start_node_b() -> None:
        while not connection.exists():
            time.sleep(0.05)
        spec = LaunchSpec(nproc_per_node=1, device="cpu", connection_file=connection,
                          log_file=tmp_path / "node-b.log", nnodes=2, rdzv_endpoint=endpoint)
        command = spec.remote_command(node_rank="1").split()
        command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
        with open(spec.log_file, "wb") as log:
            node_b.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=spec.environment(),
                                           start_new_session=True))

    thread = threading.Thread(target=start_node_b, daemon=True)
    thread.start()
    pool = Pool.start(1, device="cpu", nnodes=2, rdzv_endpoint=endpoint, workdir=tmp_path, timeout=180)
    try:
        assert pool.world_size == 2 and sorted(pool.ranks) == [0, 1]
        identity = pool.run("import os\n(world_size, int(os.environ['GROUP_RANK']))")
        assert sorted(identity.values()) == [(2, 0), (2, 1)]  # one rank on each node
        pool.run("x = torch.ones(1) * (rank + 1)\ndist.all_reduce(x)")
        assert [v.tolist() for v in pool.pull("x").values()] == [[3.0], [3.0]]
        pids = pool.pids()
    finally:
        pool.stop()
        for proc in node_b:
            try:
                proc.wait(timeout=20)  # node B's ranks exit on shutdown; its torchrun follows
            except subprocess.TimeoutExpired:
                proc.kill()
                pytest.fail("node B's torchrun did not exit after the pool stopped")
    assert_no_orphans(pids)
