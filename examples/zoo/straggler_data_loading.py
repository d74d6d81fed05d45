"""straggler (data loading): rank 1's input pipeline takes 50 ms longer every step. The model
has BatchNorm, so DDP broadcasts its buffers at the start of every forward: rank 0 waits for rank
1 inside that broadcast, not in the all-reduce. The wait is the straggler's, not the broadcast's
(a few hundred bytes): nothing may blame the broadcast. (The broadcast call itself, DDP's Python
around a gloo collective, takes 0.6-0.9 ms on a 2-core VM: 50 ms keeps that well under the
3% at which the broadcast's cost is reported, on a slow moment too.)"""

from __future__ import annotations

import time

import torch
from _zoo import Net, batch, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir, check_every=5):
        for _ in range(30):
            if rank == 1:
                time.sleep(0.05)  # a slow DataLoader on this rank
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


if __name__ == "__main__":
    launch(train)
