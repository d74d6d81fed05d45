"""What each part of ddpdoctor costs the training thread, in one process: the same model plain,
instrumented, and instrumented with a part taken off, timed in alternating blocks.

``bench/interleaved.py`` measures the whole overhead across two ranks; ``bench/hot_path.py``
times ddpdoctor's own entry points. Neither says what the rest of the training thread's added
CPU is made of: on the short model the interleaved bench reads +80-90 µs a step of CPU where
ddpdoctor's own accounting (``Monitor.own_ns``) says 40. Here one gloo rank (world size 1, one
CPU thread) builds the model several times over, each in its own DDP, and steps them in turn, a
block of ``--block`` steps each, in an order rotated every round (``--rounds``). Each row is the
median over the rounds of its block's training-thread CPU time (``thread_time``) less the first
plain contender's in the same round, in µs a step. Contenders:

* ``plain`` and ``plain-2`` (the noise row);
* ``ddpdoctor``: ``instrument`` with a NullSink (the writer thread is not what is asked here);
* ``no samples``: the same with ``check_every`` past the run (no sampled checks after the first
  steps: their share of the row above);
* ``no buffer wrapper``: the same, with DDP's buffer broadcast no longer passed through
  ddpdoctor's wrapper (its share; the model has a BatchNorm, so DDP broadcasts every forward);
* ``no forward hooks``: the same, with ddpdoctor's forward hooks removed after attach (no step is
  recorded: what is left is the comm hook, the optimizer hooks and the buffer wrapper);
* ``busy hook``: plain DDP with a forward pre-hook that runs an empty loop of ``--busy`` turns
  (10 µs warm for 1,000 here): what any Python work in a forward hook costs in place, for scale.

``Monitor.own_ns`` a step is printed for the instrumented contenders. Every contender steps the
same batches; the losses are not compared (the contenders with a part off record nothing).

    python bench/components.py [--model short|long] [--rounds 60] [--block 100] [--busy 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ddpdoctor
from bench.harness import free_port, init_gloo
from bench.overhead import SPECS, Spec
from ddpdoctor.sinks import NullSink

CONTENDERS = (
    "plain",
    "ddpdoctor",
    "no samples",
    "no buffer wrapper",
    "no forward hooks",
    "busy hook",
    "plain-2",
)


def _contender(name: str, spec: Spec, busy: int) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(spec.build(), bucket_cap_mb=spec.bucket_cap_mb)
    monitor = None
    if name not in ("plain", "plain-2", "busy hook"):
        every = {"check_every": 10**9} if name != "ddpdoctor" else {}
        monitor = ddpdoctor.instrument(ddp, sink=NullSink(), proc_interval=3600.0, **every)
        if not isinstance(monitor, ddpdoctor.Monitor):
            raise RuntimeError("ddpdoctor.instrument did not attach")
        if name == "no buffer wrapper":
            ddp.__dict__.pop("_sync_buffers", None)  # DDP's own method again
        elif name == "no forward hooks":
            for handle in monitor.attachment._handles:
                handle.remove()
    elif name == "busy hook":

        def hook(*_: Any) -> None:
            for _ in range(busy):
                pass

        ddp.register_forward_pre_hook(hook, prepend=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    return ddp, opt, monitor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SPECS), default="short")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--block", type=int, default=100)
    parser.add_argument("--busy", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_gloo(0, 1, free_port())
    spec = SPECS[args.model]
    contenders = {name: _contender(name, spec, args.busy) for name in CONTENDERS}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(spec.batch, *spec.input_shape, generator=gen)
    y = torch.randint(0, 10, (spec.batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()

    def block(name: str, steps: int) -> float:
        ddp, opt, _ = contenders[name]
        start = time.thread_time_ns()
        for _ in range(steps):
            loss = loss_fn(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return (time.thread_time_ns() - start) / steps / 1000

    for name in CONTENDERS:
        block(name, 200)  # warm-up, and past the dense start of the sampled checks
    own0 = {n: c[2].own_ns for n, c in contenders.items() if c[2] is not None}
    cpu: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for r in range(args.rounds):
        order = CONTENDERS[r % len(CONTENDERS) :] + CONTENDERS[: r % len(CONTENDERS)]
        for name in order:
            cpu[name].append(block(name, args.block))
    timed = args.rounds * args.block
    print(
        f"{args.model} model, 1 gloo rank, 1 CPU thread; {args.rounds} rounds of {args.block} steps per contender; "
        f"training-thread CPU, µs a step"
    )
    print(f"{'contender':20s} {'median':>8s} {'vs plain':>9s} {'own_ns':>7s}")
    for name in CONTENDERS:
        diffs = [a - b for a, b in zip(cpu[name], cpu["plain"], strict=True)]
        monitor = contenders[name][2]
        own = f"{(monitor.own_ns - own0[name]) / timed / 1000:7.1f}" if monitor is not None else f"{'':7s}"
        print(f"{name:20s} {statistics.median(cpu[name]):8.1f} {statistics.median(diffs):+9.1f} {own}")
    for _, _, monitor in contenders.values():
        if monitor is not None:
            monitor.close()


if __name__ == "__main__":
    os.environ.setdefault("DDPDOCTOR_NATIVE", "1")
    main()
