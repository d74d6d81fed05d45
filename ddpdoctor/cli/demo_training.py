"""The demo's training: a small real model with BatchNorm, trained by N gloo ranks on CPU."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the layers before it get their gradients late."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds  # type: ignore[attr-defined]  # autograd's ctx carries it to backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)  # type: ignore[attr-defined]  # set by forward
        return grad, None


class DemoNet(nn.Module):
    """A small convnet with BatchNorm buffers and several gradient buckets.

    ``backward_delay`` makes backward that much slower between the head and the conv layers, as
    a slower device would: the head's bucket is on time, the conv layers' buckets are late.
    """

    def __init__(self, width: int = 32, classes: int = 10, backward_delay: float = 0.0) -> None:
        super().__init__()
        self.backward_delay = backward_delay
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width * 2, 3, padding=1, stride=2),
            nn.BatchNorm2d(width * 2),
            nn.ReLU(),
            nn.Conv2d(width * 2, width * 2, 3, padding=1, stride=2),
            nn.BatchNorm2d(width * 2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Linear(width * 2, 256), nn.ReLU(), nn.Linear(256, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        if self.backward_delay:
            h = _SlowBackward.apply(h, self.backward_delay)
        out: torch.Tensor = self.head(h)
        return out


@dataclass
class DemoConfig:
    world_size: int
    steps: int
    run_dir: str
    port: int
    batch: int = 32
    bucket_cap_mb: float = 0.05  # small buckets so that even this model has several
    scenario: str = "healthy"  # "straggler": the last rank's backward is STRAGGLER_DELAY_S slower
    pace_s: float = 0.0  # pause before each step (a data loader), so a live view can follow
    output: str | None = None  # the ranks' stdout and stderr go here (the live view owns the terminal)


#: Extra backward time of the straggling rank: several times the demo's healthy step.
STRAGGLER_DELAY_S = 0.04


def train_rank(rank: int, config: DemoConfig) -> None:
    """One rank of the demo (the target of torch.multiprocessing.spawn)."""
    import ddpdoctor

    if config.output is not None:
        fd = os.open(config.output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(config.port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=config.world_size)
    try:
        torch.manual_seed(0)
        slow = config.scenario == "straggler" and rank == config.world_size - 1
        model = ddpdoctor.DistributedDataParallel(
            DemoNet(backward_delay=STRAGGLER_DELAY_S if slow else 0.0),
            bucket_cap_mb=config.bucket_cap_mb,
            ddpdoctor_run_dir=config.run_dir,
            ddpdoctor_options={"proc_interval": 1.0},
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(1000 + rank)
        loss_fn = nn.CrossEntropyLoss()
        for _ in range(config.steps):
            if config.pace_s:
                time.sleep(config.pace_s)
            x = torch.randn(config.batch, 3, 16, 16, generator=gen)
            y = torch.randint(0, 10, (config.batch,), generator=gen)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.ddpdoctor.close()
    finally:
        dist.destroy_process_group()
    # torch 2.13's gloo process group sometimes aborts in its destructors at interpreter teardown
    # ("terminate called without an active exception", ~1 run in 8, with or without ddpdoctor).
    # Everything is flushed and closed by now, so leave without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
