"""frozen-after-wrap: a layer frozen after DDP was built.

Without --find-unused DDP dies at the next iteration with "Expected to have finished reduction
in the prior iteration..."; ddpdoctor names the real cause first. With --find-unused training
goes on, all-reducing zeros for the frozen layer every step.
"""

from __future__ import annotations

import os
import sys

import torch
from _zoo import Net, batch, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor

FIND_UNUSED = os.environ.get("ZOO_FIND_UNUSED") == "1"  # set from --find-unused; ranks inherit it


def train(rank: int, world: int, run_dir: str) -> None:
    model = DDP(Net(), find_unused_parameters=FIND_UNUSED)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(model, run_dir=run_dir, check_every=5):
        for step in range(10):
            if step == 3:
                for p in model.module.body[0].parameters():  # the mistake: DDP was built with these
                    p.requires_grad_(False)
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


if __name__ == "__main__":
    if "--find-unused" in sys.argv:
        os.environ["ZOO_FIND_UNUSED"] = "1"
        sys.argv.remove("--find-unused")
    launch(train)
