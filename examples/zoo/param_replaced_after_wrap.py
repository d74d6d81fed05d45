"""param-not-reduced: a weight replaced after DDP was built (``ddp.module.fc.weight = nn.Parameter(w)``).

DDP still all-reduces the old tensor, now orphaned (with find_unused_parameters=True it gets zeros);
the new weight trains on each rank's own gradient and the replicas drift apart. ``--before``
replaces the weight before wrapping and ``--rewrap`` rebuilds DDP after the replacement
(``ddpdoctor.rewrap``): the healthy look-alikes, silent. ``--plain``: no ddpdoctor (losses compared).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from _zoo import Net, batch, launch, plain_asked, say_losses
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def pretrained_head(net: Net) -> nn.Parameter:
    torch.manual_seed(7)  # the same weights on every rank, as loaded from a checkpoint
    return nn.Parameter(torch.randn_like(net.head.weight) * 0.1)


def train(rank: int, world: int, run_dir: str) -> None:
    before, rewrap = "--before" in sys.argv[2:], "--rewrap" in sys.argv[2:]
    net = Net(batchnorm=False)
    if before:
        net.head.weight = pretrained_head(net)  # right: replaced before wrapping
    model = DDP(net, find_unused_parameters=True)
    watched = contextlib.nullcontext() if plain_asked() else ddpdoctor.instrument(model, run_dir=run_dir, check_every=5)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    with watched:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(24):
            if step == 6 and not before:
                model.module.head.weight = pretrained_head(model.module)  # the mistake (pytorch#12603)
                if rewrap:
                    model = ddpdoctor.rewrap(model)  # the fix: DDP rebuilt around the new weight
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
