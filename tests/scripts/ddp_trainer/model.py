"""The trainer's model and data (the DDP tutorial's ``datautils.py`` / ``load_train_objs`` role)."""

import torch
from torch.utils.data import Dataset


class MyTrainDataset(Dataset):
    def __init__(self, size):
        generator = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


def build_model():
    return torch.nn.Linear(20, 1)
