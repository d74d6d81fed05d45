"""What a sampled step leaves behind in every later backward.

At a sampled step the checks hook every reduced parameter to see when its gradient arrives, and
take the hooks off when the sample ends. This measures what the backward of a later, unsampled
step pays for it, with three DDP models of the same shape on one gloo rank (world size 1):

- ``untouched``: never hooked;
- ``python``: hooked and unhooked once with ``register_post_accumulate_grad_hook`` (what the
  Python route's sample does; torch keeps a C++ caller of the tensor's Python hooks);
- ``native``: hooked and unhooked once with the extension's ``ParamSample`` (C++ pre-hooks on the
  gradient accumulators, erased from the nodes at the end).

``loss.backward()`` alone is timed in blocks, the three models taking turns block by block in a
rotating order; the figures are medians over blocks of each block's median, and the difference
of each model from ``untouched`` block by block.

    python bench/sample_residue.py [--layers 100] [--blocks 21] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import free_port, init_gloo
from ddpdoctor.runtime import native_hook


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=100, help="Linear(16, 16) layers: two parameters each")
    parser.add_argument("--blocks", type=int, default=21)
    parser.add_argument("--steps", type=int, default=40, help="timed backwards per block")
    args = parser.parse_args()
    init_gloo(0, 1, free_port())
    torch.set_num_threads(1)
    extension = native_hook.load()

    def model() -> DDP:
        torch.manual_seed(0)
        return DDP(nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(args.layers)]))

    models = {"untouched": model(), "python": model(), "native": model()}
    x = torch.randn(4, 16)

    def run(m: DDP, n: int) -> list[int]:
        out = []
        for _ in range(n):
            loss = m(x).square().mean()
            m.zero_grad(set_to_none=True)
            t = time.perf_counter_ns()
            loss.backward()
            out.append(time.perf_counter_ns() - t)
        return out

    for m in models.values():
        run(m, 3)  # DDP rebuilds its buckets after the first backward
    params = list(models["python"].module.parameters())
    for handle in [p.register_post_accumulate_grad_hook(lambda p: None) for p in params]:
        handle.remove()
    sample = extension.ParamSample(list(models["native"].module.parameters()))
    run(models["native"], 1)
    sample.end(0)
    names = list(models)
    medians: dict[str, list[float]] = {name: [] for name in names}
    for block in range(args.blocks):
        for name in names[block % 3 :] + names[: block % 3]:
            medians[name].append(statistics.median(run(models[name], args.steps)) / 1000)
    base = medians["untouched"]
    print(f"{len(params)} parameters, {args.blocks} blocks x {args.steps} backwards, median µs per backward:")
    for name in names:
        diff = statistics.median(m - b for m, b in zip(medians[name], base, strict=True))
        print(
            f"  {name:10s} {statistics.median(medians[name]):8.1f}   vs untouched {diff:+7.1f} µs "
            f"({diff / len(params) * 1000:+5.0f} ns per parameter)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
