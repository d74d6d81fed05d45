"""replica-divergence in a short run: after step 5 of 30, each rank adds its own noise to one layer's
weights after optimizer.step() (rank-local regularization, a botched EMA). DDP never re-syncs
parameters: the replicas drift from step 6 on."""

from __future__ import annotations

import torch
from _zoo import Net, batch, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    noise = torch.Generator().manual_seed(100 + rank)  # a different stream on every rank
    with ddpdoctor.instrument(model, run_dir=run_dir):  # the default sampled-check schedule
        for step in range(30):
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step >= 5:
                with torch.no_grad():
                    w = model.module.body[3].weight
                    w.add_(1e-3 * torch.randn(w.shape, generator=noise))


if __name__ == "__main__":
    launch(train)
