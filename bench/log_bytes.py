"""Bytes a real job's compact log takes per rank-step, by record kind.

``bench/synth_run.py`` writes synthetic steps as regular as a clock; a real job's steps are not,
and the compact log writes the steps around each slow one in full (``sinks/compact.py``). Here
two gloo ranks (``torch.multiprocessing``, one CPU thread each) train the short model of
``bench/overhead.py`` for ``--steps`` steps under ``ddpdoctor.instrument`` with its defaults and
a file sink, nothing else running; then each rank file is read back line by line: its bytes per
rank-step, the full step records among them, and the bytes of each record kind.

    python bench/log_bytes.py [--steps 8000] [--model short|long]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import free_port, init_gloo
from bench.overhead import SPECS, _batches
from ddpdoctor.events.layout import rank_file_path


def _rank(rank: int, world: int, port: int, model: str, steps: int, out: str) -> None:
    import ddpdoctor

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    spec = SPECS[model]
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(spec.build(), bucket_cap_mb=spec.bucket_cap_mb)
    monitor = ddpdoctor.instrument(ddp, run_dir=out)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    batches = _batches(spec, rank)
    start = time.perf_counter()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        loss = loss_fn(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if rank == 0:
        print(f"{steps} steps, {(time.perf_counter() - start) / steps * 1000:.2f} ms a step", flush=True)
    monitor.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--model", choices=sorted(SPECS), default="short")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="log-bytes-") as out:
        mp.start_processes(_rank, args=(2, free_port(), args.model, args.steps, out), nprocs=2, start_method="spawn")
        for path in (rank_file_path(Path(out), r) for r in range(2)):
            sizes: collections.Counter[str] = collections.Counter()
            counts: collections.Counter[str] = collections.Counter()
            for line in path.read_bytes().splitlines(keepends=True):
                kind = json.loads(line).get("kind", "?")
                sizes[kind] += len(line)
                counts[kind] += 1
            total = sum(sizes.values())
            print(
                f"{path.name}: {total / args.steps:.1f} bytes a step, {counts['step']} full step records "
                f"({counts['step'] / args.steps:.1%} of the steps)"
            )
            for kind, size in sizes.most_common():
                print(f"    {kind:12s} {counts[kind]:6d} records {size / args.steps:7.1f} bytes a step")


if __name__ == "__main__":
    main()
