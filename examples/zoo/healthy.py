"""A healthy run: no warning or error finding (a model big enough that its step is not all latency)."""

from __future__ import annotations

from _zoo import Net, fit, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net(width=1024))
    fit(model, rank, run_dir, steps=30, batch_size=128)
    ddpdoctor.check_replicas(model)


if __name__ == "__main__":
    launch(train)
