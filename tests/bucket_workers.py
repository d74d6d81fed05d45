"""Rank-side code of the bucket advice tests (module level, so spawned children can import it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from tests.runtime_workers import _slow_link_hook

#: The caps of the two runs: a bucket per weight (latency-bound), and one bucket for the whole model.
SMALL_CAP_MB, GOOD_CAP_MB = 0.01, 25.0


def _stack() -> torch.nn.Sequential:
    """Twelve small layers, widths 128, 128, 16, ...: 64 and 8 KB weights, so at 10 KB a bucket per
    weight in two sizes eight times apart (the cost model then tells its fixed part from its
    per-byte part)."""
    torch.manual_seed(0)
    widths = [128, 128, 16] * 4 + [128]
    layers: list[torch.nn.Module] = []
    for i in range(12):
        layers += [torch.nn.Linear(widths[i], widths[i + 1]), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def latency_bound_runs(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """The same model on two ranks at ``SMALL_CAP_MB`` and at ``GOOD_CAP_MB``, one run each, every
    all-reduce completed a few ms late (``_slow_link_hook``: a slow link's latency, whatever the
    host's load), so the step is the all-reduces' fixed cost, paid once per bucket."""
    x = torch.randn(32, 128)
    for name, cap in (("small", SMALL_CAP_MB), ("good", GOOD_CAP_MB)):
        ddp = DDP(_stack(), bucket_cap_mb=cap)
        ddp.register_comm_hook(None, _slow_link_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        with ddpdoctor.instrument(ddp, run_dir=Path(tmp) / name, check_every=2):
            for _ in range(16):
                loss = ddp(x).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    return {"rank": rank}
