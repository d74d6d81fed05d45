"""unused-parameters: an auxiliary head that never takes part in the loss."""

from __future__ import annotations

import torch
from _zoo import fit, launch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 64)
        self.head = nn.Linear(64, 4)
        self.aux_head = nn.Linear(64, 10)  # left over from an experiment: never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def train(rank: int, world: int, run_dir: str) -> None:
    fit(DDP(TwoHeads(), find_unused_parameters=True), rank, run_dir, steps=8)


if __name__ == "__main__":
    launch(train)
