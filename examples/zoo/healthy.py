"""A healthy run: no warning or error finding (a model big enough that its step is not all latency)."""

from __future__ import annotations

import torch
from _zoo import Net, batch, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net(width=1024))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir, check_every=5):
        for _ in range(30):
            x, y = batch(gen, size=128)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    ddpdoctor.check_replicas(model)


if __name__ == "__main__":
    launch(train)
