"""Output under pressure: 200,000 printed lines through a real Jupyter kernel, pool vs plain kernel.

    python bench/output_flood.py [--lines 200000]

Prints one table row per case: seconds from execute to idle, lines that reached
the notebook, stream messages the notebook received.  The pool's case runs the
print loop on rank 0 of a 2-rank CPU pool (``%%megatron --ranks 0``); the plain
case runs the same loop in the kernel itself.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernel_client import Kernel  # noqa: E402


def flood(kernel: Kernel, code: str, lines: int) -> tuple[float, int, int]:
    started = time.perf_counter()
    result = kernel.execute(code, timeout=900)
    seconds = time.perf_counter() - started
    assert not result.errors, result.errors
    received = sum(text.count("\n") for _, text in result.streams)
    return seconds, received, len(result.streams)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=200_000)
    n = parser.parse_args().lines
    loop = f"for i in range({n}):\n    print('line', i)"
    kernel = Kernel()
    try:
        plain = flood(kernel, loop, n)
        kernel.ok("%load_ext mnb")
        kernel.ok("%mnb start -n 2 --device cpu")
        pool = flood(kernel, "%%megatron --ranks 0\n" + loop, n)
        kernel.ok("%mnb stop")
    finally:
        kernel.shutdown()
    print("| case | seconds | lines shown | stream messages |")
    print("|---|---|---|---|")
    for name, (seconds, received, messages) in (("plain kernel", plain), ("pool, rank 0", pool)):
        print(f"| {name} | {seconds:.2f} | {received:,} | {messages:,} |")


if __name__ == "__main__":
    main()
