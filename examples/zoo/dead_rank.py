"""rank-lost: rank 1 is killed at step 20 (SIGKILL: the out-of-memory killer, a native crash). It
writes nothing more; rank 0's next collective fails (gloo notices at once; NCCL waits until its
timeout, and the watchdog names the hang).

Run as the other zoo scripts (one launcher process; it terminates rank 0 as soon as rank 1 dies,
often before rank 0 could log its failure), or one process per rank as torchrun starts them,
where rank 0 lives to log it:

    RANK=0 MASTER_PORT=29511 python examples/zoo/dead_rank.py RUN_DIR &
    RANK=1 MASTER_PORT=29511 python examples/zoo/dead_rank.py RUN_DIR
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from _zoo import Net, _entry, batch, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir) as monitor:
        for step in range(40):
            if rank == 1 and step == 20:
                # what it logged so far is on disk (a process that ran a while has written its
                # steps; a loaded machine can keep 20 short steps in the writer's queue)
                monitor.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


if __name__ == "__main__":
    if "RANK" in os.environ:
        _entry(int(os.environ["RANK"]), train, 2, int(os.environ["MASTER_PORT"]), sys.argv[1])
    else:
        launch(train)
