"""A torchrun script that fails on its last rank after its collectives (the others finish)."""

import torch.distributed as dist

dist.init_process_group(backend="nccl")
rank = dist.get_rank()
dist.barrier()
if rank == dist.get_world_size() - 1:
    raise RuntimeError(f"bad shard on rank {rank}")
print(f"rank {rank} done")
