"""straggler (periodic, between steps): every 8th step rank 0 spends 0.6 s after optimizer.step()
(the checkpoint or evaluation only rank 0 runs); the other rank waits in the next collective."""

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
    with ddpdoctor.instrument(model, run_dir=run_dir):
        for step in range(34):
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 8 == 7:
                time.sleep(0.6)  # torch.save(model.state_dict(), ...) / evaluate(model) on rank 0 only


if __name__ == "__main__":
    launch(train)
