"""What the gradient watch costs a backward: ``DdpScale``'s C++ pre-hook on each gradient
accumulator (under ``gradient_as_bucket_view`` from a world size of 3, where DDP may divide a
gradient in place and ddpdoctor must see which).

One gloo rank, an MLP of ``--layers`` small layers (two parameters each), gradient_as_bucket_view,
gradients kept between steps, the native route, a NullSink. Two instrumented instances in the one
process group, the watch forced on in one and off in the other (at world size 1 it is never on by
itself), timed in interleaved blocks of ``--block`` steps, the order alternating. Prints the median
step time and the median of the blocks' differences, per step and per parameter, with the
quartiles of the differences.

    python bench/grad_watch.py [--layers 100] [--blocks 40] [--block 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ddpdoctor
from bench.harness import free_port, init_gloo
from ddpdoctor.runtime import native_hook
from ddpdoctor.sinks.null import NullSink


def _scale_with(watch: bool) -> Any:
    def make(module: Any, ddp: Any) -> Any:
        params = [p for p in ddp.module.parameters() if p.requires_grad] if watch else []
        return module.DdpScale(ddp.reducer, ddp.process_group.size(), params, watch)

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=40, help="timed blocks per side")
    parser.add_argument("--block", type=int, default=50, help="steps per block")
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_gloo(0, 1, free_port())
    native_hook.load()
    models: dict[bool, tuple[DDP, torch.optim.Optimizer]] = {}
    monitors = []
    original = native_hook.ddp_scale
    try:
        for watch in (True, False):
            native_hook.ddp_scale = _scale_with(watch)  # type: ignore[assignment]
            torch.manual_seed(0)
            net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(args.layers)])
            ddp = DDP(net, gradient_as_bucket_view=True, bucket_cap_mb=0.01)
            monitors.append(ddpdoctor.instrument(ddp, sink=NullSink()))
            models[watch] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4))
    finally:
        native_hook.ddp_scale = original  # type: ignore[assignment]
    x = torch.randn(4, 16)

    def block(watch: bool, steps: int) -> float:
        ddp, opt = models[watch]
        t = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad(set_to_none=False)
            ddp(x).sum().backward()
            opt.step()
        return (time.perf_counter() - t) / steps * 1e6

    for watch in (True, False):
        block(watch, 20)  # warm-up
    base, diffs = [], []
    for i in range(args.blocks):
        order = (True, False) if i % 2 else (False, True)
        took = {watch: block(watch, args.block) for watch in order}
        base.append(took[False])
        diffs.append(took[True] - took[False])
    params = 2 * args.layers
    q1, _, q3 = statistics.quantiles(diffs)
    median = statistics.median(diffs)
    print(
        f"{args.layers} layers ({params} parameters): step {statistics.median(base):.0f} µs; the watch adds "
        f"{median:+.1f} µs a step, {median / params * 1000:+.0f} ns a parameter (quartiles {q1:+.1f}, {q3:+.1f} µs)"
    )
    for monitor in monitors:
        monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
