"""constant-buffers: a fixed lookup table (1 MB) registered as a buffer, broadcast at every forward.

``--fixed`` applies the fix (``broadcast_buffers=False``); ``--forward-sleep-ms N`` adds N ms to
every forward (a planted slowdown, for ``ddpdoctor compare``).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from _zoo import fit, launch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# set from the command line below; the spawned ranks inherit the environment
FIXED = os.environ.get("ZOO_FIXED") == "1"
FORWARD_SLEEP_S = float(os.environ.get("ZOO_FORWARD_SLEEP_MS", "0")) / 1000.0


class TableNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(-1, 1, 1024 * 256).reshape(1024, 256))  # never changes
        self.proj = nn.Linear(32, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if FORWARD_SLEEP_S:
            time.sleep(FORWARD_SLEEP_S)
        h = torch.relu(self.proj(x)) + self.table[:1, :64]
        return self.head(h)


def train(rank: int, world: int, run_dir: str) -> None:
    fit(DDP(TableNet(), broadcast_buffers=not FIXED), rank, run_dir, steps=11)


if __name__ == "__main__":
    if "--fixed" in sys.argv:
        os.environ["ZOO_FIXED"] = "1"
        sys.argv.remove("--fixed")
    if "--forward-sleep-ms" in sys.argv:
        i = sys.argv.index("--forward-sleep-ms")
        os.environ["ZOO_FORWARD_SLEEP_MS"] = sys.argv[i + 1]
        del sys.argv[i : i + 2]
    launch(train)
