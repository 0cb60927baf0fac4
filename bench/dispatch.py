"""Round trip of an empty %%megatron cell on 2 CPU ranks (target: <= 10 ms median).

    python bench/dispatch.py [--ranks 2] [--cells 200]

Goes through the real magic (IPython shell, argument parsing, pre-flight
check, signed messages, rank exec loop, replies) and prints a one-line
result plus the pool start-up and a layout change for context.
"""

from __future__ import annotations

import argparse
import statistics
import time

from IPython.core.interactiveshell import InteractiveShell


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "mnb")
    t0 = time.perf_counter()
    shell.run_line_magic("mnb", f"start -n {args.ranks} --device {args.device}")
    start_s = time.perf_counter() - t0
    for _ in range(10):
        shell.run_cell_magic("megatron", "", "pass")
    times = []
    for _ in range(args.cells):
        t = time.perf_counter()
        shell.run_cell_magic("megatron", "", "pass")
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    shell.run_cell_magic("megatron", f"--tp {args.ranks}", "pass")
    relayout_s = time.perf_counter() - t
    shell.run_line_magic("mnb", "stop")
    times.sort()
    print(
        f"dispatch: {args.cells} empty cells on {args.ranks} {args.device} ranks: "
        f"median {statistics.median(times) * 1e3:.2f} ms, p90 {times[int(0.9 * len(times))] * 1e3:.2f} ms, "
        f"max {times[-1] * 1e3:.2f} ms | start {start_s:.2f} s | re-layout to tp={args.ranks} {relayout_s * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
