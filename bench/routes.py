"""Step time of ddpdoctor's two bucket-timing routes side by side, in one process.

One gloo rank (world size 1), a 5-layer MLP with small buckets (``bucket_cap_mb=0.02``), SGD, a
NullSink. Rounds interleave four modes, each on a fresh model and DDP wrapper (same seed):

- ``plain``: plain DDP;
- ``hook``: plain DDP with ddpdoctor's native C++ timed hook registered alone (no ddpdoctor);
- ``native``: ``ddpdoctor.instrument`` on the native route (the default);
- ``python``: ``ddpdoctor.instrument`` on the Python comm hook route (``DDPDOCTOR_NATIVE=0``).

With one rank, nothing waits for another process: the comm thread, the C++->Python calls and
ddpdoctor's own Python are all in the step, without a second rank's noise. A round's value is the
median step of its timed steps; the table gives the median over rounds, the overhead against
``plain`` and ddpdoctor's own training-thread time per step (``Monitor.own_us``).

    python bench/routes.py [--rounds 7] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ddpdoctor
from ddpdoctor.cli.ports import free_port
from ddpdoctor.runtime import native_hook
from ddpdoctor.sinks import NullSink

MODES = ("plain", "hook", "native", "python")
WARMUP = 50


def model() -> nn.Module:
    torch.manual_seed(0)
    h = 128
    layers: list[nn.Module] = [nn.Linear(64, h), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Linear(h, h), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(h, 10))


def one_round(mode: str, steps: int) -> tuple[float, float | None]:
    """Median step (µs) of one round, and ddpdoctor's own µs per step (None without it)."""
    ddp = DDP(model(), bucket_cap_mb=0.02)
    monitor = None
    if mode == "hook":
        native_hook.load().register_timed_hook(ddp.reducer, ddp.process_group, 4096)
    elif mode != "plain":
        os.environ["DDPDOCTOR_NATIVE"] = "1" if mode == "native" else "0"
        monitor = ddpdoctor.instrument(ddp, sink=NullSink())
        header = monitor.attachment.header
        assert header is not None and header.timing == mode, header
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    times = []
    own0 = 0.0
    for i in range(WARMUP + steps):
        if i == WARMUP and monitor is not None:
            own0 = monitor.own_us
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    own = None
    if monitor is not None:
        own = (monitor.own_us - own0) / steps
        monitor.close()
    return statistics.median(times[WARMUP:]) * 1e6, own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    native_hook.load()  # the build, if any, before the first round
    steps: dict[str, list[float]] = {m: [] for m in MODES}
    own: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]  # alternate so no mode always follows another
        for mode in order:
            step_us, own_us = one_round(mode, args.steps)
            steps[mode].append(step_us)
            if own_us is not None:
                own[mode].append(own_us)
    plain = statistics.median(steps["plain"])
    print(f"torch {torch.__version__}, 1 gloo rank, {args.rounds} rounds x {args.steps} steps, medians")
    print("| mode | step µs | over plain | ddpdoctor's own µs/step |")
    print("|---|---:|---:|---:|")
    for mode in MODES:
        med = statistics.median(steps[mode])
        own_txt = f"{statistics.median(own[mode]):.1f}" if own[mode] else ""
        over = "" if mode == "plain" else f"{(med / plain - 1) * 100:+.1f}%"
        print(f"| {mode} | {med:.0f} | {over} | {own_txt} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
