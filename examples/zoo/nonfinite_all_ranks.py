"""non-finite-gradient, every rank together: a learning rate far too high makes the run diverge.

The weights grow at every step until every rank's gradients overflow at the same step: no single
rank is the origin, and the report must not blame one.
"""

from __future__ import annotations

import contextlib

import torch
from _zoo import Net, batch, launch, plain_asked, say_losses
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net(batchnorm=False))
    opt = torch.optim.SGD(model.parameters(), lr=30.0)  # the mistake: lr 30 instead of 0.03
    gen = torch.Generator().manual_seed(rank)
    losses = []
    watched = contextlib.nullcontext() if plain_asked() else ddpdoctor.instrument(model, run_dir=run_dir, check_every=5)
    with watched:
        for _ in range(30):
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    say_losses(rank, losses)


if __name__ == "__main__":
    launch(train)
