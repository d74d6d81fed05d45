"""exposed-communication / bucket-size on a latency-bound job: ``bucket_cap_mb=0.01`` on about
1 MiB of gradients in 17 tensors gives one bucket per tensor, and every all-reduce pays its fixed
cost. The advice must never name the current cap as the best one, nor tell this run to make the
buckets smaller: it recommends a larger cap with its predicted saving, or says the replay cannot
predict the run."""

from __future__ import annotations

from _zoo import fit, launch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank: int, world: int, run_dir: str) -> None:
    net = nn.Sequential(
        nn.Linear(32, 180), *[m for _ in range(7) for m in (nn.Linear(180, 180), nn.ReLU())], nn.Linear(180, 4)
    )
    fit(DDP(net, bucket_cap_mb=0.01), rank, run_dir, steps=40)


if __name__ == "__main__":
    launch(train)
