"""hang: a rank stuck in its own code. At step 8 rank 1's forward waits for a condition that never
comes (a loop polling for a file, a lock taken twice, a data loader that never returns): it runs
no collective, and rank 0 waits for it in the next collective.

    DDPDOCTOR_HANG_TIMEOUT=3 python examples/zoo/stuck_in_compute.py RUN_DIR   # hangs: Ctrl-C
"""

from __future__ import annotations

import os
import time

import torch
from _zoo import Net, batch, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


class Stuck(Net):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 9 and int(os.environ.get("RANK", "0")) == 1:
            while not os.path.exists("/nonexistent/ready"):  # a condition that never comes
                time.sleep(0.05)
        return super().forward(x)


def train(rank: int, world: int, run_dir: str) -> None:
    os.environ["RANK"] = str(rank)
    model = DDP(Stuck())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir):
        for _ in range(20):
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


if __name__ == "__main__":
    launch(train)
