"""What the fused kernels cost to compile, per rank process (device machine, 1 GPU).

    python bench/compile_cost.py --out OUTDIR

Runs ``mnb.megatron.fusions.warm_up`` in fresh processes: twice against an empty
Inductor cache directory (cold, then warm disk cache), with Inductor's default
compile workers and with ``TORCHINDUCTOR_COMPILE_THREADS=1``.  Writes
compile_cost.json: seconds per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = (
    "import time, torch\n"
    "t = time.perf_counter()\n"
    "from mnb.megatron import fusions\n"
    "imported = time.perf_counter() - t\n"
    "from mnb.config import load_preset\n"
    "from mnb.megatron.model import fused_shapes\n"
    "shapes = fused_shapes(load_preset('llama-1b'), 1, swiglu=True)  # all three as Inductor's (GPUs run mnb's own)\n"
    "seconds = fusions.warm_up(torch.device('cuda', 0), **shapes)\n"
    "print('RESULT', imported, seconds)\n"
)


def probe(cache: str, threads: str | None) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=cache + "/triton")
    if threads:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = threads
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    if proc.returncode or not line:
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    _, imported, seconds = line[0].split()
    return {"import_s": round(float(imported), 2), "warm_up_s": round(float(seconds), 2),
            "process_s": round(time.perf_counter() - start, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "artifacts"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for threads in (None, "1"):
        with tempfile.TemporaryDirectory() as cache:
            for cache_state in ("cold", "warm"):
                row = {"compile_threads": threads or "default", "disk_cache": cache_state, **probe(cache, threads)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    (out / "compile_cost.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
