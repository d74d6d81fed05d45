"""Rank 1 skips the backward of step 2, so the job hangs.

Rank 1 goes on to step 3, whose forward broadcasts the BatchNorm buffers, while rank 0 waits in
the all-reduce of step 2's first bucket: the two ranks block in different collectives until the
test kills them (the process group's timeout is 10 minutes).

usage: skip_a_backward.py RUN_DIR HANG_TIMEOUT   (RANK, WORLD_SIZE=2, MASTER_PORT in the environment)
"""

from __future__ import annotations

from hang_job import STEPS, start

rank, ddp, opt, x, y, run_dir = start()
for step in range(STEPS):
    loss = ((ddp(x) - y) ** 2).mean()
    if rank == 1 and step == 2:
        (run_dir / "rank-1-skipped").touch()  # tells the test when the hang begins
        continue  # e.g. "skip this batch, the loss is NaN", on one rank only
    opt.zero_grad()
    loss.backward()
    opt.step()
