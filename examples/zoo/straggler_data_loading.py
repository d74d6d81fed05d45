"""straggler (data loading): rank 1's input pipeline takes 150 ms longer every step. The model
has BatchNorm, so DDP broadcasts its buffers at the start of every forward: rank 0 waits for rank
1 inside that broadcast, not in the all-reduce. The wait is the straggler's, not the broadcast's
(a few hundred bytes): nothing may blame the wait on the broadcast. (The broadcast itself, DDP's
Python around a gloo collective, costs 1.5-3 ms a step on a busy 2-core machine, measured without
ddpdoctor by turning it off: at a 50 ms delay that was 3-5% of the step, over the 3% at which the
report names the broadcast's cost. 150 ms keeps the real cost near 2%.)"""

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
                time.sleep(0.15)  # a slow DataLoader on this rank
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


if __name__ == "__main__":
    launch(train)
