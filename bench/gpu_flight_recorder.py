"""Does mnb's Flight Recorder read-out name op, group, sequence number, shape and dtype on NCCL?

One GPU: a one-rank NCCL group (no peer can be missing), so a collective is *held* instead: a long
``torch.cuda._sleep`` kernel ahead of it on the stream keeps it scheduled but not completed.

A. plain process (``TORCH_NCCL_TRACE_BUFFER_SIZE`` set here, as the launcher sets it for CUDA pools):
   3 all-reduces on the world group, 1 all-gather on Megatron's tp group, then a held all-reduce;
   ``mnb.megatron.collectives.flight_recorder()`` read while held and after it completed.
B. a 1-rank mnb pool on cuda: a cell holds an all-reduce; ``Pool.stacks_report()`` (what ``%mnb stacks``
   prints) read from another thread while it is held.

    python bench/gpu_flight_recorder.py      # on the GPU machine, one GPU; prints one table
"""

from __future__ import annotations

import os
import sys
import threading
import time

os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29631")
rows: list[tuple[str, str]] = []


def row(name: str, value) -> None:
    rows.append((name, str(value)))
    print(f"{name:<34} {value}", flush=True)


def plain() -> None:
    import torch
    import torch.distributed as dist

    from mnb.controller import hangs
    from mnb.megatron import collectives

    c10d = torch._C._distributed_c10d
    row("torch", torch.__version__)
    row("dump functions", [n for n in dir(c10d) if "dump" in n])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    x = torch.ones(4, device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    out = torch.empty(1, 2, 3, device="cuda", dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, torch.ones(2, 3, device="cuda", dtype=torch.bfloat16),
                                group=ps.get_tensor_model_parallel_group())
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of GPU time ahead of the next collective
    held = torch.ones(8, 16, device="cuda", dtype=torch.float16)
    dist.all_reduce(held)
    snap = collectives.flight_recorder()
    row("A held: source", snap and snap["source"])
    for group in (snap or {}).get("groups", []):
        row(f"A held: {hangs.group_text(group)}", f"calls {group['calls']}, last {group['last']}")
    row("A held: waiting in", hangs.waiting_in(snap))
    torch.cuda.synchronize()
    time.sleep(1.5)  # the watchdog marks completion on its own thread
    row("A after sync: waiting in", hangs.waiting_in(collectives.flight_recorder()))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def pool() -> None:
    from mnb.controller import Pool

    p = Pool.start(1, device="cuda", timeout=170)
    try:
        started = time.monotonic()
        done: list = []
        cell = ("x = torch.ones(4, 8, device=device, dtype=torch.bfloat16)\nfor _ in range(2):\n"
                "    dist.all_reduce(x)\ntorch.cuda._sleep(int(1e10))\ndist.all_reduce(x)\ntorch.cuda.synchronize()")
        t = threading.Thread(target=lambda: done.append(p.run(cell, timeout=120, quiet=True)))
        t.start()
        report = ""
        while "all_reduce" not in report and time.monotonic() - started < 60 and t.is_alive():
            report = p.stacks_report()
        row("B pool: stacks_report lines", [line for line in report.splitlines() if line.startswith("in ")])
        t.join(120)
        row("B pool: cell finished", bool(done))
    finally:
        p.stop()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    began = time.monotonic()
    for part in (plain, pool):
        try:
            part()
        except Exception as exc:  # noqa: BLE001 - a table row says what failed
            row(f"{part.__name__} failed", f"{type(exc).__name__}: {exc}")
    row("seconds", round(time.monotonic() - began, 1))
    print("\n| check | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
