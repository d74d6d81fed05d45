"""Rank 1 skips the backward of step 2, so the job hangs.

Rank 1 goes on to step 3, whose forward broadcasts the BatchNorm buffers, while rank 0 waits in
the all-reduce of step 2's first bucket: the two ranks block in different collectives until the
test kills them (the process group's timeout is 10 minutes).

usage: skip_a_backward.py RUN_DIR HANG_TIMEOUT   (RANK, WORLD_SIZE=2, MASTER_PORT in the environment)
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import ddpdoctor
from tests.models import make_model

STEPS = 6


rank = int(os.environ["RANK"])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600))
torch.manual_seed(0)
ddp = DDP(make_model(), bucket_cap_mb=0.01)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
x, y = torch.randn(16, 32), torch.randn(16, 4)
run_dir = Path(sys.argv[1])
monitor = ddpdoctor.instrument(ddp, run_dir=run_dir, hang_timeout=float(sys.argv[2]))
for step in range(STEPS):
    loss = ((ddp(x) - y) ** 2).mean()
    if rank == 1 and step == 2:
        (run_dir / "rank-1-skipped").touch()  # tells the test when the hang begins
        continue  # e.g. "skip this batch, the loss is NaN", on one rank only
    opt.zero_grad()
    loss.backward()
    opt.step()
