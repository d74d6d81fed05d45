"""Healthy look-alike of non-finite-gradient: targets in the 1e15s give a loss near 1e30, finite.

Nothing is NaN or infinite: ddpdoctor must stay silent about non-finite gradients.
"""

from __future__ import annotations

import contextlib

import torch
from _zoo import Net, batch, launch, plain_asked, say_losses
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net(batchnorm=False))
    opt = torch.optim.SGD(model.parameters(), lr=1e-32)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    watched = contextlib.nullcontext() if plain_asked() else ddpdoctor.instrument(model, run_dir=run_dir, check_every=5)
    with watched:
        for _ in range(20):
            x, y = batch(gen)
            loss = ((model(x) - y * 1e15) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    say_losses(rank, losses)


if __name__ == "__main__":
    launch(train)
