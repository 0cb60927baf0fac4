"""A plain PyTorch DDP training script, written for GPUs and torchrun.

    torchrun --nproc-per-node 2 tests/scripts/ddp_torchrun.py --steps 5 --out /tmp/ddp

Each rank writes its final weights' checksum and losses to OUT/rank{RANK}.json, so a
test can compare them (DDP keeps the replicas identical).
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    assert world_size == int(os.environ["WORLD_SIZE"]) and rank == int(os.environ["RANK"])

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).cuda()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    losses = []
    for _ in range(args.steps):
        x = torch.randn(8, 16, generator=generator).cuda()
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": world_size, "argv": sys.argv, "name": __name__,
                   "file": __file__, "path0": sys.path[0], "losses": losses, "checksum": checksum,
                   "master": [os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")],
                   "local_world_size": os.environ.get("LOCAL_WORLD_SIZE")}, f)
    print(f"rank {rank}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.exit(0)
