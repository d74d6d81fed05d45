"""Where ddpdoctor's time goes on the training thread: µs per step in each of its entry points.

One gloo rank (world size 1), a 9-layer MLP with 4 gradient buckets, a NullSink. Every ddpdoctor
entry point on the hot path is wrapped with a timer; the figures are totals per step over
``--steps`` steps after a warm-up. Nested entries (indented) are included in their parents.

    python bench/hot_path.py [--steps 1000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ddpdoctor
from bench.harness import free_port, init_gloo
from ddpdoctor.runtime import comm_hook, live_findings, sampled_checks, step_recorder
from ddpdoctor.runtime import monitor as monitor_module
from ddpdoctor.sinks import NullSink

TOTALS: dict[str, int] = {}

PROBES = [
    (monitor_module.Monitor, "_forward_pre", "forward pre-hook"),
    (step_recorder.StepRecorder, "_emit_step", "  step record"),
    (live_findings.LiveFindings, "observe", "    live checks"),
    (sampled_checks.SampledChecks, "check_grad_flags", "  requires_grad check"),
    (monitor_module.Monitor, "on_forward_post", "forward post-hook"),
    (monitor_module.Monitor, "on_bucket_ready", "bucket ready"),
    (step_recorder.StepRecorder, "bucket_launched", "bucket launched"),
    (step_recorder.StepRecorder, "bucket_done", "bucket done (gloo thread)"),
    (comm_hook, "mean_allreduce", "inner all-reduce call"),
    (monitor_module.Monitor, "_on_backward_end", "backward-end callback"),
    (monitor_module.Monitor, "on_optimizer", "optimizer hooks"),
]


def _wrap(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            TOTALS[label] = TOTALS.get(label, 0) + time.perf_counter_ns() - start

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    init_gloo(0, 1, free_port())
    for owner, name, label in PROBES:
        _wrap(owner, name, label)
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(8)], nn.Linear(64, 4))
    ddp = DDP(net, bucket_cap_mb=0.02)
    monitor = ddpdoctor.instrument(ddp, sink=NullSink(), proc_interval=1000)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(8, 64), torch.randn(8, 4)

    def step() -> None:
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(100):
        step()
    TOTALS.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    wall_us = (time.perf_counter() - start) / args.steps * 1e6
    current = monitor.recorder.current
    buckets = len(current.ready) if current is not None else 0
    monitor.close()
    print(f"step {wall_us:.0f} µs (instrumented, timers included), {buckets} buckets, {args.steps} steps")
    for _, _, label in PROBES:
        print(f"  {label:30s} {TOTALS.get(label, 0) / args.steps / 1000:7.1f} µs/step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
