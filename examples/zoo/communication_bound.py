"""exposed-communication (communication-bound): big weights, little compute per step. The finding
predicts the step with a compression hook (half the bytes) and with the bucket size the what-if
recommends. No rank is slower: no straggler, even while other work loads the machine."""

from __future__ import annotations

import torch
from _zoo import fit, launch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 2048)
        # a table of which each step reads one row, like an embedding with dense gradients: 16 MiB
        # to all-reduce per step for almost no compute (a Linear of that size computes enough per
        # byte of gradient to put the exposed share near the warning line on a slow CPU)
        self.table = nn.Parameter(torch.zeros(2048, 2048))
        self.out = nn.Linear(2048, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x) + self.table[0]))


def train(rank: int, world: int, run_dir: str) -> None:
    fit(DDP(Wide()), rank, run_dir, steps=40, batch_size=4)


if __name__ == "__main__":
    launch(train)
