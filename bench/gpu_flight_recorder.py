"""Does mnb's Flight Recorder read-out name op, group, sequence number, shape and dtype on NCCL?

One GPU, so a one-rank NCCL group (no peer can be missing): a collective is *held* instead, by a long
``torch.cuda._sleep`` kernel ahead of it on the stream (scheduled, not completed).  The GPU side uses
torch alone and writes the raw dumps; the read-out runs anywhere on them::

    OUT=/tmp/fr python bench/gpu_flight_recorder.py dump   # on the GPU machine (TORCH_FR_BUFFER_SIZE set here)
    python bench/gpu_flight_recorder.py read /tmp/fr         # mnb.megatron.collectives.from_trace on the dumps

Run 2026-12-02 on 1×H200, torch 2.11.0+cu130 (results in the i29-hangs report): ``_dump_nccl_trace`` and
``_dump_fr_trace`` both exist; a dump takes 0.2 ms; the held call reads
``all_reduce #4 of world group [0], tensor [8, 16] float16, scheduled`` and nothing once it completed.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time


def dump(out: str) -> None:
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    import torch
    import torch.distributed as dist

    c10d = torch._C._distributed_c10d
    info = {"torch": torch.__version__, "dumps": [n for n in dir(c10d) if "dump" in n]}
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    group = dist.new_group([0])
    x = torch.ones(4, device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    out_t = torch.empty(1, 2, 3, device="cuda", dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out_t, torch.ones(2, 3, device="cuda", dtype=torch.bfloat16), group=group)
    torch.cuda.synchronize()
    read = getattr(c10d, "_dump_nccl_trace", None) or c10d._dump_fr_trace
    info["names"] = {dist.distributed_c10d._get_default_group().group_name: "world", group.group_name: "tp"}
    torch.cuda._sleep(int(5e9))  # seconds of GPU time ahead of the next collective
    work = dist.all_reduce(torch.ones(8, 16, device="cuda", dtype=torch.float16), async_op=True)
    began = time.perf_counter()
    held = read(True, False, False)
    info["dump_s"] = time.perf_counter() - began
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "held.pkl"), "wb") as f:
        f.write(held)
    torch.cuda.synchronize()
    work.wait()
    time.sleep(2)  # the watchdog marks completion on its own thread
    with open(os.path.join(out, "after.pkl"), "wb") as f:
        f.write(read(True, False, False))
    with open(os.path.join(out, "info.json"), "w") as f:
        json.dump(info, f)
    dist.destroy_process_group()


def read(folder: str) -> None:
    from mnb.controller import hangs
    from mnb.megatron.collectives import from_trace

    with open(os.path.join(folder, "info.json")) as f:
        info = json.load(f)
    print(f"torch {info['torch']}, dump functions {info['dumps']}, one dump {info['dump_s'] * 1e3:.2f} ms")
    for name in ("held", "after"):
        with open(os.path.join(folder, f"{name}.pkl"), "rb") as f:
            snap = from_trace(pickle.loads(f.read()), info["names"])
        groups = [f"{hangs.group_text(g)}: {g['calls']} calls, last {g['last']}" for g in snap["groups"]]
        print(f"{name:<6} {groups} waiting in {hangs.waiting_in(snap)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["dump"]:
        dump(os.environ.get("OUT", "/tmp/fr"))
    else:
        read(sys.argv[2] if len(sys.argv) > 2 else "/tmp/fr")
