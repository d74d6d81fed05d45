"""buffer-divergence: BatchNorm statistics drift apart with broadcast_buffers=False."""

from __future__ import annotations

from _zoo import Net, fit, launch
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net(), broadcast_buffers=False)
    fit(model, rank, run_dir, steps=11, finally_check=True)  # the explicit check names the drifted statistics


if __name__ == "__main__":
    launch(train)
