"""What the zoo scripts share: a 2-rank gloo launcher on CPU, a small model, data.

Each script is plain PyTorch DDP training with one line of ddpdoctor (``instrument``); run it as

    python examples/zoo/<name>.py [RUN_DIR]
    ddpdoctor report RUN_DIR
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

Train = Callable[[int, int, str], None]


class Net(nn.Module):
    """A small MLP with BatchNorm."""

    def __init__(self, batchnorm: bool = True, width: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(32, width),
            nn.BatchNorm1d(width) if batchnorm else nn.Identity(),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def batch(gen: torch.Generator, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 32, generator=gen), torch.randn(size, 4, generator=gen)


def fit(
    model: nn.Module, rank: int, run_dir: str, steps: int, batch_size: int = 16, finally_check: bool = False
) -> None:
    """The plain training loop of the scripts whose problem is in the model or the DDP options,
    instrumented with one line; ``finally_check`` ends with ``ddpdoctor.check_replicas`` while the
    monitor is still attached (so what it finds is logged too)."""
    import ddpdoctor

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir, check_every=5):
        for _ in range(steps):
            x, y = batch(gen, batch_size)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if finally_check:
            ddpdoctor.check_replicas(model)


def _entry(rank: int, train: Train, world: int, port: int, run_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # same initial weights everywhere (DDP would broadcast them anyway)
    train(rank, world, run_dir)
    gc.collect()
    dist.destroy_process_group()
    # torch 2.13's gloo process group sometimes aborts in its destructors at interpreter exit;
    # the run is complete and its log closed, so skip them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(train: Train, world: int = 2) -> None:
    """Run ``train(rank, world, run_dir)`` on ``world`` gloo ranks; RUN_DIR is argv[1]."""
    run_dir = (
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.join("ddpdoctor-runs", "zoo-" + os.path.basename(sys.argv[0])[:-3])
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"run dir: {run_dir}", flush=True)
    # as mp.spawn, each rank imports this script afresh, but forked from a server that imported
    # torch and dynamo (which DDP's constructor imports) once for both ranks: seconds of CPU less
    mp.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo"])
    mp.start_processes(_entry, args=(train, world, port, run_dir), nprocs=world, start_method="forkserver")


def plain_asked() -> bool:
    """``--plain`` on the command line: the same training without ddpdoctor (losses compared)."""
    return "--plain" in sys.argv[2:]


def say_losses(rank: int, losses: list[float]) -> None:
    """Every step's loss, exactly (float.hex): a run with ddpdoctor and one without must print the
    same line."""
    sys.stdout.flush()
    # one write of the whole line: the ranks share the pipe, and a line under PIPE_BUF stays whole
    os.write(sys.stdout.fileno(), f"rank {rank} losses: {' '.join(x.hex() for x in losses)}\n".encode())
