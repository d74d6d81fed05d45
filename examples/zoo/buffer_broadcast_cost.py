"""buffer-broadcast-cost: large buffers, updated every step, broadcast at every forward."""

from __future__ import annotations

import torch
from _zoo import fit, launch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class EmaNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 4)
        self.register_buffer("feature_ema", torch.zeros(4_000_000))  # 16 MB of running statistics

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.feature_ema.mul_(0.99).add_(x.mean(), alpha=0.01)
        return self.lin(x)


def train(rank: int, world: int, run_dir: str) -> None:
    fit(DDP(EmaNet()), rank, run_dir, steps=26)


if __name__ == "__main__":
    launch(train)
