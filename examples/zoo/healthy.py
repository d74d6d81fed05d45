"""A healthy run: no warning or error finding (a model big enough that its step is not all latency)."""

from __future__ import annotations

from _zoo import Net, fit, launch
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank: int, world: int, run_dir: str) -> None:
    fit(DDP(Net(width=1024)), rank, run_dir, steps=30, batch_size=128, finally_check=True)


if __name__ == "__main__":
    launch(train)
