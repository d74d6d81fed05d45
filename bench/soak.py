"""Soak: does what one rank keeps, and what a step costs ddpdoctor, stay flat over a long run?

One gloo rank (world size 1, a free port), a small model that exercises every sampled check: a
constant buffer (constant-buffers evidence), a BatchNorm (changing buffers), a parameter that
never gets a gradient under ``find_unused_parameters=True`` (unused-parameter evidence), and a
short ``check_every`` so the run makes ``--checks`` sampled checks or more. The log goes to a
real file in a temporary run dir, as in a job.

Per block of steps it prints the process RSS (MiB, after the block) and ddpdoctor's own µs per
step in the block: the monitor's own accounting (``Monitor.own_ns``: its time in its forward
hooks, buffer-broadcast wrapper less the broadcast, and bucket-ready), not the step time, which
the machine's noise dominates.

    python bench/soak.py [--checks 10000] [--check-every 2] [--blocks 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ddpdoctor
from bench.harness import free_port, init_gloo
from ddpdoctor.runtime.checks.sampled import is_sampled


class Net(nn.Module):
    """Two layers with a BatchNorm between, a constant table read at every forward, one unused layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.bn = nn.BatchNorm1d(64)
        self.b = nn.Linear(64, 8)
        self.spare = nn.Linear(8, 8)  # never used: no gradient at any step
        self.register_buffer("table", torch.randn(1024))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x)))) + self.table[:8]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checks", type=int, default=10_000, help="sampled checks to make at least")
    ap.add_argument("--check-every", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=12)
    args = ap.parse_args()
    steps = args.checks * args.check_every + args.check_every
    block = -(-steps // args.blocks)
    steps = block * args.blocks

    warnings.simplefilter("ignore")  # the findings this model earns are warned once; not the point here
    init_gloo(0, 1, free_port())
    torch.manual_seed(0)
    model = DDP(Net(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    with tempfile.TemporaryDirectory() as run_dir:
        mon = ddpdoctor.instrument(model, run_dir, check_every=args.check_every)
        print(
            f"soak: 1 rank, {steps} steps, check_every={args.check_every}, "
            f"{sum(is_sampled(i, args.check_every) for i in range(steps))} sampled checks, "
            f"blocks of {block} steps, torch {torch.__version__}",
            flush=True,
        )
        print(
            f"{'block':>5} {'steps':>7} {'checks':>7} {'RSS MiB':>8} {'own µs/step':>12} "
            f"{'p50 checked':>12} {'p50 other':>10} {'step ms p50':>12}"
        )
        rows = []
        checks = 0
        for b in range(args.blocks):
            own0 = mon.own_ns
            times = []
            # own time per step, split by whether the step was a sampled check (its hooks and
            # records are handled at the next step's forward pre-hook: counted with that step)
            checked: list[float] = []
            other: list[float] = []
            for i in range(b * block, (b + 1) * block):
                t = time.perf_counter()
                before = mon.own_ns
                opt.zero_grad(set_to_none=True)
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                times.append(time.perf_counter() - t)
                sampled = is_sampled(i, args.check_every)
                (checked if sampled else other).append((mon.own_ns - before) / 1000.0)
                checks += sampled
            own_us = (mon.own_ns - own0) / 1000.0 / block
            rows.append((rss_mib(), own_us))
            print(
                f"{b:>5} {(b + 1) * block:>7} {checks:>7} {rows[-1][0]:>8.1f} {own_us:>12.1f} "
                f"{statistics.median(checked) if checked else float('nan'):>12.1f} "
                f"{statistics.median(other) if other else float('nan'):>10.1f} "
                f"{statistics.median(times) * 1000:>12.3f}",
                flush=True,
            )
        mon.close()
        size = sum(p.stat().st_size for p in Path(run_dir).rglob("*") if p.is_file())
    # the first block holds the warm-up (allocator, first checks): growth is measured after it
    rss = [r for r, _ in rows[1:]]
    own = [o for _, o in rows[1:]]
    half = len(own) // 2
    print(
        f"RSS blocks 1..{len(rows) - 1}: {rss[0]:.1f} -> {rss[-1]:.1f} MiB ({rss[-1] - rss[0]:+.1f}); "
        f"own µs/step: first half median {statistics.median(own[:half]):.1f}, "
        f"second half median {statistics.median(own[half:]):.1f}; log {size / 2**20:.1f} MiB on disk"
    )
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
