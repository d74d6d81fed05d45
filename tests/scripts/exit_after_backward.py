"""Instrumented DDP that exits right after its last backward (no close, no destroy_process_group):
the gloo workers are still releasing that backward's all-reduces when the interpreter finalizes.

On torch 2.13 a gloo work made during backward holds the contextvars Context torch stashes
there; a worker that releases it during finalization needs the GIL and the process aborts
("terminate called without an active exception"). Plain DDP does so in about a third of runs on
a loaded 2-core machine; ddpdoctor's own all-reduces and callbacks must never do it.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]), bucket_cap_mb=0.1)
monitor = ddpdoctor.instrument(model, run_dir=sys.argv[1], hang_timeout=0)
for _ in range(3):
    model(torch.randn(32, 256)).sum().backward()
