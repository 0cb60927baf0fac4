"""The same Megatron job as a pool cell, as a plain torchrun script (no pool, no notebook).

    MNB_LAUNCH_T=$(python -c 'import time; print(time.time())') \\
    torchrun --standalone --nproc-per-node 2 bench/plain_torchrun.py --layout tp=2 --steps 10 --result r.json

Reports the time from launch (MNB_LAUNCH_T, set just before torchrun starts)
to the first finished training step — what a cold relaunch costs for every
layout change without a pool — and tokens/s over the remaining steps, to
compare the pool's throughput against.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layout", default="tp=1", help="comma-separated, e.g. tp=2,pp=1")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--fp32", action="store_true", help="train in fp32 (CPU ranks)")
    parser.add_argument("--num-layers", type=int, default=None, help="override the preset's layers")
    parser.add_argument("--no-fusions", action="store_true", help="Megatron's own ops (no compiled kernels)")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    launched = float(os.environ.get("MNB_LAUNCH_T", time.time()))

    import torch
    import torch.distributed as dist

    from mnb.config import ParallelConfig
    from mnb.megatron.layout import apply_layout
    from mnb.megatron.model import gpt
    from mnb.megatron.train import train

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        from mnb.megatron import cpu

        cpu.install()
        dist.init_process_group("gloo")
    layout = {k: int(v) for k, v in (item.split("=") for item in args.layout.split(","))}
    apply_layout(ParallelConfig(**layout))
    overrides = {"num_layers": args.num_layers} if args.num_layers else {}
    if args.no_fusions:
        overrides["fusions"] = False
    model = gpt(args.preset, seq_length=args.seq, **overrides)
    bf16 = not args.fp32
    record = train(model, steps=1, micro_batch_size=args.mbs, global_batch_size=args.gbs, bf16=bf16)
    if args.device == "cuda":
        torch.cuda.synchronize()
    first_step_s = time.time() - launched
    result = {"first_step_s": round(first_step_s, 2)}
    if args.steps > 1:
        record = train(model, steps=args.steps, micro_batch_size=args.mbs, global_batch_size=args.gbs, bf16=bf16)
        tokens = [s["tokens_per_s"] for s in record["steps"][1:]]
        result["tokens_per_s"] = round(sum(tokens) / len(tokens))
    if dist.get_rank() == 0:
        with open(args.result, "w") as handle:
            json.dump(result, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
