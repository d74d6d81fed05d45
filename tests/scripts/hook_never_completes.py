"""A comm hook whose future never completes from step 2 on, on every rank: the job hangs with no
rank missing (every rank waits in the same all-reduce), until the test kills it.

usage: hook_never_completes.py RUN_DIR HANG_TIMEOUT   (RANK, WORLD_SIZE=2, MASTER_PORT in the environment)
"""

# (no postponed annotations: DDP checks the hook's annotations as objects)
from typing import Any

import torch
import torch.distributed as dist
from hang_job import STEPS, start
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

rank, ddp, opt, x, y, run_dir = start()
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
