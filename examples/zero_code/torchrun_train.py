"""A plain DDP training script, no ddpdoctor in it: ``ddpdoctor run`` instruments it from outside.

    ddpdoctor run --run-dir runs/zero-code -- torchrun --standalone --nproc-per-node 2 \\
        examples/zero_code/torchrun_train.py
    ddpdoctor report runs/zero-code
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(steps: int) -> float:
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    model = DDP(net, bucket_cap_mb=0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.randn(32, 32, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun provides RANK, WORLD_SIZE, MASTER_ADDR/PORT
    loss = train(args.steps)
    if dist.get_rank() == 0:
        print(f"final loss {loss:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
