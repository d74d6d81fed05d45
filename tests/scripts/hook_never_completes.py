"""A comm hook whose future never completes from step 2 on, on every rank: the job hangs with no
rank missing (every rank waits in the same all-reduce), until the test kills it.

usage: hook_never_completes.py RUN_DIR HANG_TIMEOUT   (RANK, WORLD_SIZE=2, MASTER_PORT in the environment)
"""

# (no postponed annotations: DDP checks the hook's annotations as objects)
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
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
calls = {"n": 0}


def stuck_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages as DDP does, until step 2: then a future that nobody completes (a hook bug)."""
    if calls["n"] >= 2:
        if bucket.is_last():
            (run_dir / f"rank-{rank}-stuck").touch()  # tells the test when the hang begins
        return torch.futures.Future()
    if bucket.is_last():
        calls["n"] += 1
    return default_hooks.allreduce_hook(state, bucket)


ddp.register_comm_hook(None, stuck_hook)
for _ in range(STEPS):
    loss = ((ddp(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
