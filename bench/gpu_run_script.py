"""Cold ``torchrun`` vs warm ``%mnb run``: time to the first step of Megatron-LM's ``pretrain()``.

    python bench/gpu_run_script.py --gpus 1 --out bench/gpu_run_script.json

Three measurements of bench/pretrain_gpt.py --mock-data (mock data, a Llama-style 4-layer model):

1. cold: ``torchrun --nproc-per-node N bench/pretrain_gpt.py --mock-data ARGS`` from this process,
   wall time from the launch to the ``first step at`` line (the script's own number is
   printed too: its time from import to first step inside the fresh process);
2. warm 1: the same script through ``Pool.run_script`` on a pool started beforehand
   (the pool's start is reported, not counted);
3. warm 2: the same again (imports, CUDA context, NCCL communicators already there).

The pool API is used because the GPU machine has no IPython; ``%mnb run`` calls the
same ``Pool.run_script``.  ``--device cpu`` is for a smoke check of this driver only:
``pretrain()`` asserts CUDA, so on CPU ranks the script fails at once (reported).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "pretrain_gpt.py"  # with --mock-data
PRETRAIN_ARGS = [
    "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--ffn-hidden-size", "4096",
    "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "4",
    "--global-batch-size", "16", "--train-iters", "10", "--lr", "3e-4", "--bf16", "--vocab-size", "32000",
    "--transformer-impl", "local", "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "5", "--no-gradient-accumulation-fusion",
    "--use-distributed-optimizer", "--mock-data", "--tokenizer-type", "NullTokenizer",
]
FIRST = re.compile(r"first step at ([0-9.]+) s")


def cold(nproc: int) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(SCRIPT),
         *PRETRAIN_ARGS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_wall, inner, tail = None, None, []
    for line in proc.stdout:
        tail.append(line)
        match = FIRST.search(line)
        if match and first_wall is None:
            first_wall, inner = time.perf_counter() - start, float(match.group(1))
    code = proc.wait()
    return {"first_step_wall_s": first_wall, "first_step_in_script_s": inner, "total_s": time.perf_counter() - start,
            "exit_code": code, "output": "".join(tail[:60] + ["...\n"] + tail[-60:]) if code else ""}


def warm(pool, label: str) -> dict:
    import io
    from contextlib import redirect_stdout

    buffer = io.StringIO()
    start = time.perf_counter()
    error = None
    with redirect_stdout(buffer):
        try:
            pool.run_script(SCRIPT, PRETRAIN_ARGS)
        except Exception as exc:  # reported in the result: a benchmark records failures
            error = f"{type(exc).__name__}: {exc}"
    total = time.perf_counter() - start
    firsts = [float(m.group(1)) for m in FIRST.finditer(buffer.getvalue())]
    # In a warm rank T0 is the script's start (its module is executed afresh), so this is
    # time from %mnb run to the first step, less the request's round trip (milliseconds).
    return {"run": label, "first_step_in_script_s": min(firsts) if firsts else None, "total_s": total,
            "error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from mnb.controller import Pool

    result: dict = {"script": str(SCRIPT), "args": PRETRAIN_ARGS, "ranks": args.gpus, "device": args.device}
    if args.device == "cuda":
        result["cold"] = cold(args.gpus)
    started = time.perf_counter()
    pool = Pool.start(args.gpus, device=args.device, timeout=600)
    result["pool_start_s"] = time.perf_counter() - started
    try:
        result["warm"] = [warm(pool, "first %mnb run"), warm(pool, "second %mnb run")]
    finally:
        pool.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
