"""constant-buffers: a fixed lookup table registered as a buffer, broadcast at every forward."""

from __future__ import annotations

import torch
from _zoo import fit, launch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class TableNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(-1, 1, 256 * 64).reshape(256, 64))  # never changes
        self.proj = nn.Linear(32, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x)) + self.table[:1]
        return self.head(h)


def train(rank: int, world: int, run_dir: str) -> None:
    fit(DDP(TableNet()), rank, run_dir, steps=11)


if __name__ == "__main__":
    launch(train)
