"""Train, checkpoint on rank 0, resume on every rank with map_location (a GPU trainer's resume path).

    torchrun --nproc-per-node 2 save_resume.py --ckpt /tmp/ckpt.pt
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
args = parser.parse_args()
local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("nccl")
torch.cuda.set_device(local_rank)
torch.manual_seed(7)
model = DDP(torch.nn.Linear(4, 4).to(f"cuda:{local_rank}"), device_ids=[local_rank])
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)


def step(i):
    x = torch.full((2, 4), float(i + local_rank), device=f"cuda:{local_rank}")
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"rank {local_rank} step {i} loss {loss.item():.6f}")


for i in range(2):
    step(i)
if dist.get_rank() == 0:
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, args.ckpt)
dist.barrier()
by_string = torch.load(args.ckpt, map_location="cuda:0")
by_dict = torch.load(args.ckpt, map_location={"cuda:0": f"cuda:{local_rank}"})
by_callable = torch.load(args.ckpt, map_location=lambda storage, loc: storage.cuda(local_rank))
same = all(torch.equal(by_string["model"][k], v) and torch.equal(by_callable["model"][k], v)
           for k, v in by_dict["model"].items())
model.module.load_state_dict(by_dict["model"])
optimizer.load_state_dict(by_dict["optimizer"])
print(f"rank {local_rank} resumed, the three loads agree: {same}")
for i in range(2, 4):
    step(i)
dist.destroy_process_group()
