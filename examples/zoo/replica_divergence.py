"""replica-divergence: a parameter edited by hand on one rank only (a botched manual sync)."""

from __future__ import annotations

import torch
from _zoo import Net, batch, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir, check_every=5):
        for step in range(12):
            if step == 4 and rank == 1:
                with torch.no_grad():
                    model.module.head.weight.add_(1e-3)  # rank-local change: DDP never undoes it
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        ddpdoctor.check_replicas(model)  # the explicit check says the same, on demand


if __name__ == "__main__":
    launch(train)
