"""param-not-reduced: a classifier head reassigned after DDP was built, for a fine-tuning stage.

``ddp.module.head = nn.Linear(...)`` with find_unused_parameters=True (as transformers' Trainer
sets it): the new head trains on each rank's own gradient, never all-reduced, while DDP
all-reduces zeros for the old one. ``--plain``: no ddpdoctor (losses compared).
"""

from __future__ import annotations

import contextlib

import torch
from _zoo import Net, batch, launch, plain_asked, say_losses
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net(batchnorm=False), find_unused_parameters=True)
    watched = contextlib.nullcontext() if plain_asked() else ddpdoctor.instrument(model, run_dir=run_dir, check_every=5)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    with watched:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(24):
            if step == 8:  # stage 2: a new head for the fine-tuning task (the mistake: after wrapping)
                torch.manual_seed(3)
                model.module.head = nn.Linear(64, 4)
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    say_losses(rank, losses)


if __name__ == "__main__":
    launch(train)
