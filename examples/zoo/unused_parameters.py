"""unused-parameters: an auxiliary head that never takes part in the loss."""

from __future__ import annotations

import torch
from _zoo import launch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 64)
        self.head = nn.Linear(64, 4)
        self.aux_head = nn.Linear(64, 10)  # left over from an experiment: never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(TwoHeads(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir, check_every=5):
        for _ in range(8):
            x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


if __name__ == "__main__":
    launch(train)
