"""Healthy look-alike of lone_validation: rank 0 validates alone every 5 steps, through
``model.module`` (the bare model: no DDP collective), so no collective is one off and nothing is
found. ``--every-rank``: every rank validates through the DDP wrapper (each broadcasts the
buffers once more, together), also healthy."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _zoo import Net, batch, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor

EVERY_RANK = "--every-rank" in sys.argv


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir, check_every=5):
        for step in range(30):
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 5 == 4 and (EVERY_RANK or rank == 0):
                net = model if EVERY_RANK else model.module
                net.eval()
                with torch.no_grad():
                    x, y = batch(gen, 32)
                    ((net(x) - y) ** 2).mean().item()
                net.train()
        dist.barrier()


if __name__ == "__main__":
    launch(train)
