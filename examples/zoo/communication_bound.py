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
        self.wide = nn.Linear(2048, 2048)  # 16 MiB of gradient per step for a batch of 4
        self.out = nn.Linear(2048, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.wide(torch.relu(self.inp(x)))))


def train(rank: int, world: int, run_dir: str) -> None:
    fit(DDP(Wide()), rank, run_dir, steps=40, batch_size=4)


if __name__ == "__main__":
    launch(train)
