"""unfrozen-after-wrap: a layer unfrozen after DDP was built: its gradient is never synchronized."""

from __future__ import annotations

import torch
from _zoo import Net, batch, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def train(rank: int, world: int, run_dir: str) -> None:
    net = Net()
    for p in net.body[0].parameters():
        p.requires_grad_(False)  # frozen when DDP is built: DDP will never reduce it
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir, check_every=5):
        for step in range(12):
            if step == 2:
                for p in model.module.body[0].parameters():  # the mistake: no rebuild of DDP
                    p.requires_grad_(True)
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


if __name__ == "__main__":
    launch(train)
