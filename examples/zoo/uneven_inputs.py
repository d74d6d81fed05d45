"""hang: uneven inputs. Rank 1 has fewer batches than rank 0 (a dataset split by hand, no
DistributedSampler): it leaves its training loop and waits in the final barrier while rank 0 waits
in its next step's collectives. ``--join``: the same loop under ``Join``, which shadows the
collectives of a rank that ran out of data (the healthy look-alike: it finishes, nothing found).

    DDPDOCTOR_HANG_TIMEOUT=3 python examples/zoo/uneven_inputs.py RUN_DIR   # hangs: Ctrl-C
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from _zoo import Net, batch, launch
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor

JOIN = "--join" in sys.argv


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    batches = 20 if rank == 0 else 14  # the shards are not the same size
    with ddpdoctor.instrument(model, run_dir=run_dir):
        with Join([model]) if JOIN else contextlib.nullcontext():
            for _ in range(batches):
                x, y = batch(gen)
                loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        dist.barrier()  # everyone done before the checkpoint


if __name__ == "__main__":
    launch(train)
