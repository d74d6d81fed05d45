"""find-unused-unneeded: find_unused_parameters=True on a model that uses every parameter."""

from __future__ import annotations

from _zoo import Net, fit, launch
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank: int, world: int, run_dir: str) -> None:
    fit(DDP(Net(), find_unused_parameters=True), rank, run_dir, steps=11)  # "just in case"


if __name__ == "__main__":
    launch(train)
