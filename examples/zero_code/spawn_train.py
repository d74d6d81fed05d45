"""Plain DDP started with ``torch.multiprocessing.spawn``, no ddpdoctor in it.

ddpdoctor run --run-dir runs/spawn -- python examples/zero_code/spawn_train.py --ranks 2
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.parallel
from torch import nn


def worker(rank: int, world_size: int, port: int, steps: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    train(rank, steps)
    dist.destroy_process_group()


def train(rank: int, steps: int) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    model = torch.nn.parallel.DistributedDataParallel(net)  # named through the module, not imported
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        loss = model(torch.randn(16, 16, generator=gen)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.ranks, port, args.steps), nprocs=args.ranks, join=True)
    print("spawned training done", flush=True)


if __name__ == "__main__":
    main()
