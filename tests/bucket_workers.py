"""Rank-side code of the bucket advice tests (module level, so spawned children can import it)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor

#: The caps of the two runs: a bucket per weight (latency-bound), and one bucket for the whole model.
SMALL_CAP_MB, GOOD_CAP_MB = 0.01, 25.0
#: The fixed cost every all-reduce pays (ms): a slow link's latency, well above what a loaded
#: 2-core host adds to a step's jitter (at 2 ms, a load average of 20 once left the saving in
#: one replayed step of four under the 5% the advice asks for).
LINK_MS = 6.0


def slow_link_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real (not string) annotations
    """DDP's all-reduce (the mean), completed ``LINK_MS`` late, in gloo's thread as a transfer would."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    future = dist.all_reduce(tensor, async_op=True).get_future()  # type: ignore[union-attr]

    def arrived(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        time.sleep(LINK_MS / 1000.0)
        return done.value()[0]

    return future.then(arrived)


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
    all-reduce completed ``LINK_MS`` late (``slow_link_hook``), so the step is the all-reduces'
    fixed cost, paid once per bucket."""
    x = torch.randn(32, 128)
    for name, cap in (("small", SMALL_CAP_MB), ("good", GOOD_CAP_MB)):
        ddp = DDP(_stack(), bucket_cap_mb=cap)
        ddp.register_comm_hook(None, slow_link_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        with ddpdoctor.instrument(ddp, run_dir=Path(tmp) / name, check_every=2):
            for _ in range(16):
                loss = ddp(x).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    return {"rank": rank}
