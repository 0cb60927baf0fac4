"""A nanoGPT-style trainer: globals as config, overridden by ./configurator.py; data in ./data.

    torchrun --standalone --nproc_per_node=2 train.py

Written for GPUs: ``device = f"cuda:{ddp_local_rank}"``, TF32, bf16 autocast, a GradScaler,
pinned batches, DDP with ``device_ids``.  Run from the folder that holds configurator.py
and data/train.bin (as nanoGPT is run from its repository).
"""

import os
import time
from contextlib import nullcontext

import numpy as np
import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig

# default config values
dataset = "data"
batch_size = 4
block_size = 16
n_layer = 2
n_head = 2
n_embd = 32
learning_rate = 1e-3
max_iters = 5
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
seed = 1337
exec(open("configurator.py").read())  # overrides from the current directory, as nanoGPT does

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="nccl")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{ddp_local_rank}"
    torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
else:
    master_process, seed_offset, device = True, 0, "cuda"
torch.manual_seed(seed + seed_offset)
torch.cuda.manual_seed(seed + seed_offset)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.autocast(device_type=device_type, dtype=ptdtype)

data = np.memmap(os.path.join(dataset, "train.bin"), dtype=np.uint16, mode="r")


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == "cuda":
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


model = GPT(GPTConfig(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
model.to(device)
scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(0.1, learning_rate, (0.9, 0.95), device_type)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])
torch.cuda.reset_peak_memory_stats()
X, Y = get_batch()
t0 = time.time()
for iter_num in range(max_iters):
    with ctx:
        logits, loss = model(X, Y)
    X, Y = get_batch()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print(f"rank {seed_offset} iter {iter_num}: loss {loss.item():.6f}")
if master_process:
    print(f"dtype {dtype}; peak memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB "
          f"(now {torch.cuda.memory_allocated()}) on {torch.cuda.get_device_name(torch.cuda.current_device())}; "
          f"{time.time() - t0:.2f} s")
if ddp:
    destroy_process_group()
