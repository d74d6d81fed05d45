"""non-finite-gradient: rank 1 alone gets a bad batch at step 12; its NaN goes through the all-reduce.

From step 13 every rank's loss is NaN. Only a look at rank 1's gradients before they are averaged
tells where it came from: rank 1, step 12, the bucket and the parameters.
"""

from __future__ import annotations

import contextlib

import torch
from _zoo import Net, batch, launch, plain_asked, say_losses
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net(batchnorm=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    watched = contextlib.nullcontext() if plain_asked() else ddpdoctor.instrument(model, run_dir=run_dir, check_every=5)
    with watched:
        for step in range(20):
            x, y = batch(gen)
            if rank == 1 and step == 12:
                x[3, 5] = float("nan")  # the bad sample: one rank, one step
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    say_losses(rank, losses)


if __name__ == "__main__":
    launch(train)
