"""A test script of a distributed-training library's kind: it needs two GPUs and says so.

    torchrun --nproc-per-node 2 two_gpus.py
"""

import os
import sys

import torch
import torch.distributed as dist

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    print("Unable to locate sufficient 2 gpus to run this example. Exiting.")
    sys.exit(1)

dist.init_process_group("nccl", device_id=torch.device(f"cuda:{os.environ['LOCAL_RANK']}"))
rank = dist.get_rank()
device = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.manual_seed_all(42)
torch.manual_seed(42)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cuda")
for step in range(3):
    x = torch.randn(4, 8, device=device) + rank
    with torch.cuda.amp.autocast(dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    print(f"rank {rank} step {step} loss {loss.item():.6f}")
torch.cuda.empty_cache()
dist.barrier()
dist.destroy_process_group()
