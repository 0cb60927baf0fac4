"""Start and automatic restart with and without standby ranks, side by side in one run.

    PYTHONPATH=$PWD python bench/standby_restart.py [-n 2] [--device cpu] [--repeats 2] [--out FILE]

Per mode (``standby="off"``, then ``"on"``), per repeat:

- start: ``Pool.start`` -> every rank ready (what ``%mnb start`` waits for), in a fresh pool;
- restart: a cell kills the last rank; from the moment that cell returned (the automatic restart under
  way) to the next cell done (with standby: once the standby waits for go, as after any pause);
- stop/start: ``Pool.stop`` then ``Pool.start`` again in the same process (adopts the parked
  standby when on).

Prints one JSON object with the medians and every sample, and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from gpu_measure import standby_ready, timed_restart
from mnb.controller import Pool

KILL = "import os, signal\nif rank == world_size - 1: os.kill(os.getpid(), signal.SIGKILL)\nimport time; time.sleep(60)"


def one(mode: str, n: int, device: str) -> dict:
    t = time.perf_counter()
    pool = Pool.start(n, device=device, standby=mode, timeout=300)
    start_s = time.perf_counter() - t
    try:
        restart_s, restart_note = timed_restart(pool, KILL)
        standby_ready(pool)
    finally:
        pool.stop()
    t = time.perf_counter()
    pool = Pool.start(n, device=device, standby=mode, timeout=300)
    again_s, again_note = time.perf_counter() - t, pool.start_note
    pool.stop()
    return {"start_s": start_s, "restart_to_next_cell_s": restart_s, "restart_note": restart_note,
            "stop_start_s": again_s, "stop_start_note": again_note}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result: dict = {}
    for repeat in range(args.repeats):
        for mode in ("off", "on"):  # interleaved: load on the machine hits both alike
            result.setdefault(mode, []).append(one(mode, args.n, args.device))
    summary = {mode: {key: round(statistics.median(s[key] for s in samples), 2)
                      for key in ("start_s", "restart_to_next_cell_s", "stop_start_s")}
               for mode, samples in result.items()}
    text = json.dumps({"median": summary, "samples": result}, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
