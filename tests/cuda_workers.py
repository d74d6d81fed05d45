"""Rank-side code of the GPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from tests.models import make_model


def nccl_train(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    ddp = DDP(make_model().to(device), device_ids=[device.index], bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 4, device=device)
    with ddpdoctor.instrument(ddp, run_dir=Path(tmp)):
        torch.cuda.set_sync_debug_mode("error")  # any device synchronization raises
        try:
            for _ in range(6):
                loss = ((ddp(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return {"rank": rank}
