"""sync-during-accumulation: 4 micro-batches per optimizer step, each one all-reduced."""

from __future__ import annotations

import torch
from _zoo import Net, batch, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor

ACCUM = 4


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net(batchnorm=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir, check_every=5):
        for i in range(ACCUM * 8):
            x, y = batch(gen)
            (((model(x) - y) ** 2).mean() / ACCUM).backward()  # the mistake: no model.no_sync()
            if (i + 1) % ACCUM == 0:
                opt.step()
                opt.zero_grad()


if __name__ == "__main__":
    launch(train)
