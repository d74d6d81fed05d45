"""A rank that trains until it is killed (for the SIGTERM tests).

usage: train_until_killed.py RUN_DIR  (RANK, WORLD_SIZE, MASTER_PORT in the environment)
With STALL_AFTER=N, rank 1 stops taking part after N steps, so rank 0 blocks inside the
all-reduce of its next backward, in native code.
"""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import ddpdoctor
from tests.models import make_model

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
stall_after = int(os.environ.get("STALL_AFTER", "-1"))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=world)
ddp = DDP(make_model(), bucket_cap_mb=0.01)
monitor = ddpdoctor.instrument(ddp, run_dir=sys.argv[1])
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
x, y = torch.randn(16, 32), torch.randn(16, 4)
step = 0
while True:
    if rank == 1 and step == stall_after:
        threading.Event().wait()  # stop taking part, forever
    loss = ((ddp(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
