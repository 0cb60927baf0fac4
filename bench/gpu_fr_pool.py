"""The hang read-out through a one-rank CUDA pool: ``%mnb stacks`` names an NCCL collective that waits.

    python bench/gpu_fr_pool.py --out OUT/fr_pool.json

One GPU, so nothing can be missing from the group: the all-reduce is *held* on the GPU by a long
``torch.cuda._sleep`` kernel queued ahead of it, and the rank then waits in ``.item()``.  While it
waits, ``Pool.stacks_report()`` (what ``%mnb stacks`` prints) must name the call from PyTorch's Flight
Recorder (mnb enables it for CUDA pools): operation, group, sequence number, shape and dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HELD = """
import torch, torch.distributed as dist
x = torch.ones(8, 16, device=device, dtype=torch.float16)
for _ in range(3):
    dist.all_reduce(x)
torch.cuda.synchronize()
torch.cuda._sleep(int(6e9))   # ~3 s of GPU time ahead of the next all-reduce
dist.all_reduce(x)
x.sum().item()
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-out/fr_pool.json")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from mnb.controller.pool import Pool

    pool = Pool.start(1, device=args.device, timeout=300)
    row: dict = {}
    try:
        done: list = []
        cell = threading.Thread(target=lambda: done.append(pool.run(HELD, quiet=True, timeout=120)))
        began = time.monotonic()
        cell.start()
        report = ""
        while "all_reduce #" not in report and cell.is_alive() and time.monotonic() - began < 60:
            time.sleep(0.2)
            report = pool.stacks_report()
        cell.join(120)
        row = {"report": report, "named": "all_reduce #" in report and "[8, 16]" in report,
               "cell_finished": bool(done), "seconds_to_name": round(time.monotonic() - began, 2)}
    except Exception as exc:  # the table says what failed
        row = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        pool.stop()
    print(json.dumps(row, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
