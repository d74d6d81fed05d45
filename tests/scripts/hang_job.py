"""What the hang scripts share: two gloo ranks (RANK, WORLD_SIZE=2, MASTER_PORT in the
environment; a 10-minute process-group timeout, so only the test ends the hang) training a small
model under ddpdoctor with the hang timeout of argv[2], logging to argv[1]."""

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import ddpdoctor
from tests.models import make_model

STEPS = 6
#: the monitor, held for the process's life (as the scripts held it before)
monitor: Any = None


def start() -> tuple[int, Any, Any, torch.Tensor, torch.Tensor, Path]:
    """(rank, the instrumented DDP, its optimizer, a batch x and y, the run dir)."""
    rank = int(os.environ["RANK"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600))
    torch.manual_seed(0)
    ddp = DDP(make_model(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randn(16, 4)
    run_dir = Path(sys.argv[1])
    global monitor
    monitor = ddpdoctor.instrument(ddp, run_dir=run_dir, hang_timeout=float(sys.argv[2]))
    return rank, ddp, opt, x, y, run_dir
