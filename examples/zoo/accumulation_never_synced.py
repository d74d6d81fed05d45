"""gradients-never-synchronized: gradient accumulation where every micro-step, the last included,
runs inside ``no_sync()`` (an off-by-one): no gradient is ever all-reduced.

``--first``: the other off-by-one, the first micro-step outside ``no_sync()`` instead of the last (the
optimizer then applies three micro-steps never synchronized). ``--right``: the last micro-step
outside ``no_sync()`` (silent). ``--plain``: no ddpdoctor (losses compared).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from _zoo import Net, batch, launch, plain_asked, say_losses
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor

ACCUMULATE = 4


def train(rank: int, world: int, run_dir: str) -> None:
    right, first = "--right" in sys.argv[2:], "--first" in sys.argv[2:]
    model = DDP(Net(batchnorm=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    watched = contextlib.nullcontext() if plain_asked() else ddpdoctor.instrument(model, run_dir=run_dir, check_every=5)
    with watched:
        for i in range(40):
            last = (i + 1) % ACCUMULATE == 0
            # the mistake: ``i % ACCUMULATE < ACCUMULATE`` is always true (meant: ``not last``)
            in_no_sync = (not last) if right else i % ACCUMULATE != 0 if first else i % ACCUMULATE < ACCUMULATE
            x, y = batch(gen)
            with model.no_sync() if in_no_sync else contextlib.nullcontext():
                loss = ((model(x) - y) ** 2).mean() / ACCUMULATE
                loss.backward()
            if last:
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    say_losses(rank, losses)


if __name__ == "__main__":
    launch(train)
