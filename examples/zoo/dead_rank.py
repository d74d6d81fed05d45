"""rank-lost: rank 1 is killed at step 8 (SIGKILL: the out-of-memory killer, a native crash). It
writes nothing more; rank 0's next collective fails (gloo notices at once; NCCL waits until its
timeout, and the watchdog names the hang)."""

from __future__ import annotations

import os
import signal

import torch
from _zoo import Net, batch, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir):
        for step in range(20):
            if rank == 1 and step == 8:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


if __name__ == "__main__":
    launch(train)
