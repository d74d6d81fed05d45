"""buffer-broadcast-cost, redundant: a large buffer that changes at every forward, the same way on
every rank (a decay schedule, not data statistics), broadcast from rank 0 at every forward anyway.
Beside it a constant buffer of random floats (a fixed projection): it never changes, so it is no
buffer "that changes" (its float32 fingerprint sum differs from the header's float64 checksum in
the last bits, which is no change)."""

from __future__ import annotations

import torch
from _zoo import fit, launch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class DecayNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 4)
        self.register_buffer("mask", torch.ones(4_000_000))  # 16 MB, decayed identically everywhere
        projection = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
        self.register_buffer("projection", projection)  # constant, the same on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mask.mul_(0.999)
        return (self.lin(x) * self.mask[:4]) @ self.projection


def train(rank: int, world: int, run_dir: str) -> None:
    fit(DDP(DecayNet()), rank, run_dir, steps=26)


if __name__ == "__main__":
    launch(train)
