"""A DDP trainer in the style of the PyTorch examples' DDP series (multigpu_torchrun.py).

    torchrun --standalone --nproc-per-node 2 multigpu_torchrun.py 3 1 --batch_size 8

Written for GPUs: the Trainer holds ``gpu_id`` (LOCAL_RANK), moves the model with
``.to(gpu_id)``, wraps it in ``DDP(model, device_ids=[gpu_id])``, pins its batches.
"""

import os
import subprocess

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from model import MyTrainDataset, build_model


def ddp_setup():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="nccl")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model.to(self.gpu_id)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        self.model = DDP(self.model, device_ids=[self.gpu_id], output_device=self.gpu_id)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        self.train_data.sampler.set_epoch(epoch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for source, targets in self.train_data:
            source = source.pin_memory().to(self.gpu_id, non_blocking=True)
            targets = targets.to(self.gpu_id)
            loss = self._run_batch(source, targets)
        end.record()
        torch.cuda.synchronize()
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)} | "
              f"loss {loss:.6f}")
        return start.elapsed_time(end)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            elapsed_ms = self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                torch.save({"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}, self.snapshot_path)
        return elapsed_ms


def main(save_every, total_epochs, batch_size, snapshot_path):
    ddp_setup()
    torch.manual_seed(0)
    dataset = MyTrainDataset(64)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset, batch_size=batch_size, pin_memory=True, shuffle=False,
                        sampler=DistributedSampler(dataset))
    trainer = Trainer(model, loader, optimizer, save_every, snapshot_path)
    elapsed_ms = trainer.train(total_epochs)
    print(f"[GPU{trainer.gpu_id}] last epoch took {elapsed_ms:.1f} ms on {torch.cuda.get_device_name()}")
    subprocess.run(["echo", f"echo from rank {os.environ['RANK']}"], check=True)
    destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=8, type=int, help="Input batch size on each device")
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path)
