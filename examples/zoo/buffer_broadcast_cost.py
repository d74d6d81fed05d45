"""buffer-broadcast-cost: large buffers, updated every step, broadcast at every forward."""

from __future__ import annotations

import torch
from _zoo import launch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


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
    model = DDP(EmaNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir, check_every=5):
        for _ in range(26):
            x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


if __name__ == "__main__":
    launch(train)
