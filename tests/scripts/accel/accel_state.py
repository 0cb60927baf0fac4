"""A script on accelerate's process state (PartialState), as its own torchrun examples are.

    torchrun --nproc-per-node 2 accel_state.py
"""

import torch
from accelerate import PartialState

state = PartialState()
print(f"process {state.process_index} of {state.num_processes}: {state.distributed_type}")
torch.manual_seed(3 + state.process_index)
weight = torch.nn.Parameter(torch.zeros(3, device=state.device))
for step in range(2):
    loss = ((weight - torch.randn(3, device=state.device)) ** 2).sum()
    loss.backward()
    with torch.no_grad():
        weight -= 0.1 * weight.grad
        weight.grad = None
    print(f"rank {state.process_index} step {step} loss {loss.item():.6f}")
with state.main_process_first():
    pass
state.wait_for_everyone()
