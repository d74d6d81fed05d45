"""hang, mismatched-collectives: rank 0 validates alone, through the DDP wrapper, every 5 steps
(``model.eval()`` under ``torch.no_grad()``, a model with BatchNorm, default broadcast_buffers).

Each of those forwards broadcasts the module buffers from rank 0, a collective rank 1 never runs:
it pairs silently with rank 1's next training broadcast, and every later broadcast is one off.
Nothing fails until the end: rank 0 waits forever in a broadcast while rank 1 sits in the final
barrier. ``--grad``: the validation runs with grad enabled (no ``torch.no_grad()``), and the job
hangs in training instead. Run with a short hang timeout to see the finding soon:

    DDPDOCTOR_HANG_TIMEOUT=3 python examples/zoo/lone_validation.py RUN_DIR   # hangs: Ctrl-C
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _zoo import Net, batch, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor

GRAD = "--grad" in sys.argv


def validate(model: torch.nn.Module, gen: torch.Generator) -> float:
    model.eval()
    x, y = batch(gen, 32)
    if GRAD:
        loss = ((model(x) - y) ** 2).mean().item()
    else:
        with torch.no_grad():
            loss = ((model(x) - y) ** 2).mean().item()
    model.train()
    return loss


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir, check_every=5):
        for step in range(30):
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 5 == 4:
                validate(model, gen)  # the bug: through the wrapper, on rank 0 alone
        dist.barrier()


if __name__ == "__main__":
    launch(train)
