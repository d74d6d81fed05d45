"""A plain DDP training script with ddpdoctor attached: run it with torchrun.

torchrun --standalone --nproc-per-node 2 examples/train_instrumented.py --run-dir runs/example
ddpdoctor report runs/example
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", default=None, help="default: $DDPDOCTOR_RUN_DIR or ddpdoctor-runs/<new>")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # torchrun provides RANK, WORLD_SIZE, MASTER_ADDR/PORT
    run_dir = train(args.run_dir, args.steps)
    if dist.get_rank() == 0:
        print(f"ddpdoctor log: {run_dir}")
    # The DDP model is gone by now (it lived in train()), and so is everything of it ddpdoctor held.
    dist.destroy_process_group()


def train(run_dir: str | None, steps: int) -> str:
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    model = DDP(net, bucket_cap_mb=0.25)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir) as monitor:
        for _ in range(steps):
            x = torch.randn(64, 64, generator=gen)
            y = torch.randint(0, 10, (64,), generator=gen)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return str(monitor.run_dir)


if __name__ == "__main__":
    main()
