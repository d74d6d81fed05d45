"""Gradual unfreezing done right: rebuild DDP with ddpdoctor.rewrap after each unfreeze.

    python examples/gradual_unfreeze.py RUN_DIR           # right: rewrap after each change
    python examples/gradual_unfreeze.py RUN_DIR --wrong   # wrong: unfreeze without rebuilding DDP
    ddpdoctor report RUN_DIR

Fine-tuning often trains the head first and unfreezes deeper blocks later. DDP decides in its
constructor which gradients it synchronizes, so a block unfrozen later is trained with each
rank's local gradient and the replicas drift apart. ``ddpdoctor.rewrap(model)`` rebuilds DDP
with the same options; the optimizer, built once over all parameters, keeps working.
"""

from __future__ import annotations

import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor

STEPS_PER_STAGE = 4


def build() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)]
    return nn.Sequential(*blocks, nn.Linear(32, 4))


def train(rank: int, run_dir: str, wrong: bool) -> None:
    net = build()
    for block in net[:3]:
        block.requires_grad_(False)  # stage 0: only the head trains
    model = DDP(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)  # all parameters, frozen ones included
    initial = [p.detach().clone() for p in net.parameters()]
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir, check_every=4):
        for stage in range(4):
            if stage:
                net[3 - stage].requires_grad_(True)  # unfreeze the next block from the top
                if not wrong:
                    model = ddpdoctor.rewrap(model)
            for _ in range(STEPS_PER_STAGE):
                x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        findings = ddpdoctor.check_replicas(model, warn=wrong)
    trained = sum(not torch.equal(a, b) for a, b in zip(initial, net.parameters(), strict=True))
    print(
        f"rank {rank}: {trained}/{len(initial)} parameter tensors trained, replicas identical: {not findings}",
        flush=True,
    )


def _entry(rank: int, port: int, run_dir: str, wrong: bool) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    train(rank, run_dir, wrong)
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 gloo may abort in its destructors at exit; all is flushed already


if __name__ == "__main__":
    wrong = "--wrong" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--wrong"]
    run_dir = args[0] if args else "ddpdoctor-runs/gradual-unfreeze"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(port, run_dir, wrong), nprocs=2)
