"""straggler (intermittent, backward): rank 1's backward is 120 ms slower on every third step only
(latest in a third of the steps, yet it costs the other rank more than a second)."""

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
    slow = {"now": False}

    def delay(grad: torch.Tensor) -> torch.Tensor:
        if slow["now"]:
            time.sleep(0.12)  # e.g. a co-located process or data-dependent work on this rank
        return grad

    if rank == 1:
        model.module.head.weight.register_hook(delay)  # runs inside backward, before DDP's bucket is ready
    with ddpdoctor.instrument(model, run_dir=run_dir):
        for step in range(30):
            slow["now"] = step % 3 == 2
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


if __name__ == "__main__":
    launch(train)
