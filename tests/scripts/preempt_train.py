"""The preemption pattern, no ddpdoctor in it: a signal handler sets a flag, the step finishes,
the ranks agree to stop, rank 0 writes a checkpoint, every rank exits 0.

usage (under torchrun): preempt_train.py OUT_DIR {before|after} {TERM|INT}
``before``: the handler is installed before DDP is built; ``after``: once DDP is built.
Each rank writes ``OUT_DIR/pid-RANK`` once it trained 3 steps (the test then signals it) and
prints ``rank R steps N`` at the end.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

out, when, signame = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sig = getattr(signal, f"SIG{signame}")
stop = False


def on_signal(signum: int, frame: object) -> None:
    global stop
    stop = True


torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
if when == "before":
    signal.signal(sig, on_signal)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), bucket_cap_mb=0.001)
if when == "after":
    signal.signal(sig, on_signal)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(rank)
steps = 0
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    steps += 1
    if steps == 3:
        (out / f"pid-{rank}").write_text(str(os.getpid()))
    flag = torch.tensor([1 if stop else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops after the same step
    if flag.item():
        break
else:
    sys.exit(3)  # never signalled
if rank == 0:
    torch.save(model.module.state_dict(), out / "checkpoint.pt")
dist.barrier()
print(f"rank {rank} steps {steps}", flush=True)
dist.destroy_process_group()
sys.exit(0)
