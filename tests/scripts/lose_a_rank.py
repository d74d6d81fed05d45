"""Rank 1 kills itself with SIGKILL after step 5 and 1 s of training; rank 0 trains on until the group times out.

usage: lose_a_rank.py RUN_DIR   (RANK, WORLD_SIZE=2, MASTER_PORT in the environment)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import ddpdoctor
from tests.models import make_model

rank = int(os.environ["RANK"])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=8))
ddp = DDP(make_model(), bucket_cap_mb=0.01)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
x, y = torch.randn(16, 32), torch.randn(16, 4)
with ddpdoctor.instrument(ddp, run_dir=sys.argv[1]):
    # timed from the first step on: attaching can take a while (the run dir agreed through the
    # store, the native hook loaded), and steps 0-4 must not all fall in the last flush interval
    start = time.monotonic()
    for step in range(100_000):
        # after 1 s of training the writer thread has flushed at least a few times (every 200 ms)
        if rank == 1 and step >= 5 and time.monotonic() - start > 1.0:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
