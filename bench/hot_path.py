"""Where ddpdoctor's time goes on the training thread: µs per step in each of its entry points.

One gloo rank (world size 1), a 9-layer MLP with 4 gradient buckets (``--bn``: with BatchNorm
between the layers, so DDP broadcasts buffers at every forward), a NullSink. Two passes of
``--steps`` steps each, after a warm-up:

1. a timer around each entry point that torch or gloo calls (the top-level rows): their totals,
   and the per-step and per-bucket sums the goal is stated in;
2. timers around the functions inside them as well (the indented rows): where a top-level row's
   time goes. Nested timers cost time of their own, so the top-level rows come from pass 1.

The sampled checks (``check_every``, 50 by default) run inside the forward pre-hook (a sample
begins and ends there, and, where DDP has no buffers to broadcast, the fingerprint is taken
there too) and, where it broadcasts buffers (``--bn``), in a one-shot pre-hook of the wrapped
module (the fingerprint, after the broadcast): their cost is a few hundred µs on one step in 50,
shown amortized per step like everything else. The goal's figure is the last line: the per-step
rows and the fingerprint hook's, summed.

Figures are µs per step, totals over the pass divided by its steps.

On the native route the optimizer step's hooks are C++ callables (they stamp the clock and run no
Python): no timer can wrap them, so their rows stay at 0. The step-time row counts them.

Before the passes, with no timer anywhere: the same model plain and instrumented (two DDP
instances in the one process group), timed in ``--pairs`` alternating blocks of ``--block``
steps. The median of the pairs' differences is what instrumenting adds to a whole step, including
what ddpdoctor's callbacks cost torch's own work after them (caches they evict).

``--device cuda``: the same on one GPU (NCCL, world size 1), where buckets take the Python route
and every mark is a CUDA event; pass 2 adds rows for the CUDA clock's calls (recording, querying
and resolving events). The bench waits for the GPU around each timed block, never inside a step.

    python bench/hot_path.py [--steps 1000] [--bn] [--route native|python] [--pairs 10] [--block 200] [--device cuda]
        [--check-every N]
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
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ddpdoctor
from bench.harness import free_port, init_gloo
from ddpdoctor.runtime.checks import fingerprints, live_findings
from ddpdoctor.runtime.checks import sampled as sampled_checks
from ddpdoctor.runtime.step import clocks, comm_hook, native_hook, optimizer_hooks
from ddpdoctor.runtime.step import hooks as hooks_module
from ddpdoctor.runtime.step import recorder as step_recorder
from ddpdoctor.sinks import NullSink

TOTALS: dict[str, int] = {}
#: every call's ns, per top-level row (pass 1): the medians say what a routine step costs, with
#: none of the sampled or batched work (a change to the routine path shows there undiluted)
CALLS: dict[str, list[int]] = {}

#: Entry points torch or gloo calls: (owner, attribute, label, where). ``where`` sorts them into
#: the goal's sums: "step" (training thread, once a step), "bucket" (training thread, once a
#: bucket), "gloo" (gloo's thread, once a bucket), "sampled" (training thread, sampled steps only:
#: one in ``check_every``), "" (not ddpdoctor's own time alone).
TOP = [
    (hooks_module.StepHooks, "on_forward_pre", "forward pre-hook", "step"),
    (hooks_module.StepHooks, "on_forward_post", "forward post-hook", "step"),
    (hooks_module.StepHooks, "on_sync_buffers", "buffer broadcast (wrapper + broadcast)", ""),
    (hooks_module.StepHooks, "on_bucket_ready", "bucket ready", "bucket"),
    (step_recorder.StepRecorder, "bucket_launched", "bucket launched", "bucket"),
    (step_recorder.StepRecorder, "bucket_done", "bucket done (gloo thread)", "gloo"),
    (comm_hook, "mean_allreduce", "inner all-reduce call", ""),
    (hooks_module.StepHooks, "_on_backward_end", "backward-end callback", "step"),
    (optimizer_hooks.OptimizerHooks, "_pre", "optimizer pre-hook", "step"),
    (optimizer_hooks.OptimizerHooks, "_post", "optimizer post-hook", "step"),
    (sampled_checks.SampledChecks, "_on_module_pre", "fingerprint hook (sampled steps, --bn)", "sampled"),
    # the native route: no Python per bucket, and none in the backward (its start and end are
    # stamped in C++; Python only for a leaf output: these two rows). Its per-step side runs
    # inside the monitor's hooks: the rows below them (pass 2)
    (native_hook._OutputGradHook, "__call__", "native: backward start (leaf output)", "step"),
    (native_hook.NativeTiming, "on_backward_end", "native: backward end (leaf output)", "step"),
]

#: Functions inside the entry points (pass 2 only), indented under the row they belong to.
NESTED = [
    (hooks_module.StepHooks, "_forward_pre", "  full path (forwards that are not routine)", "forward pre-hook"),
    (step_recorder.StepRecorder, "forward_start", "    forward_start (closes the step)", "forward pre-hook"),
    (native_hook.NativeTiming, "drain", "    native: ring drained", "forward pre-hook"),
    (hooks_module.StepHooks, "take_optimizer", "    native: optimizer stamps taken", "forward pre-hook"),
    (native_hook.NativeTiming, "on_sync_forward", "    native: stamps pending", "forward pre-hook"),
    (step_recorder.StepRecorder, "_close", "  step closed (and the batch emitted)", "forward pre-hook"),
    (step_recorder.StepRecorder, "_record", "    step record built", "forward pre-hook"),
    (live_findings.LiveFindings, "observe_steps", "    live checks of the records", "forward pre-hook"),
    (sampled_checks.SampledChecks, "on_step_start", "  sampled checks (a sample ends)", "forward pre-hook"),
    (sampled_checks.SampledChecks, "check_grad_flags", "    requires_grad changed", "forward pre-hook"),
    (sampled_checks.SampledChecks, "sample_if_due", "  sample due (from next_sample on)", "forward pre-hook"),
    (sampled_checks.SampledChecks, "begin_sample", "    sample begins (sampled steps only)", "forward pre-hook"),
    (sampled_checks.SampledChecks, "end_sample", "    sample ends (the step after)", "forward pre-hook"),
    (sampled_checks.SampledChecks, "fingerprint", "  fingerprint taken (in the hook, or at once)", "forward pre-hook"),
    (sampled_checks.SampledChecks, "_buffers", "  fp: buffers", "fingerprint hook (sampled steps, --bn)"),
    (fingerprints.Fingerprinter, "take", "  fp: take", "fingerprint hook (sampled steps, --bn)"),
]


#: ``--device cuda``: the CUDA clock's calls, inside the rows above (pass 2).
CUDA_ROWS = [
    (clocks.CudaClock, "now", "CUDA event recorded"),
    (clocks.CudaClock, "ready", "CUDA events queried (ready)"),
    (clocks.CudaClock, "rel_us", "CUDA events resolved (elapsed_time)"),
    (clocks.CudaClock, "us", "CUDA event pairs resolved (us)"),
]


def _wrap(owner: Any, name: str, label: str) -> Any:
    original = getattr(owner, name, None)
    if original is None:  # not in this tree (an older one, compared side by side): a row of 0
        return None

    calls = CALLS.setdefault(label, [])

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            took = time.perf_counter_ns() - start
            TOTALS[label] = TOTALS.get(label, 0) + took
            calls.append(took)

    setattr(owner, name, timed)
    return original


def _model(bn: bool) -> nn.Module:
    torch.manual_seed(0)
    norm: list[nn.Module] = [nn.BatchNorm1d(64)] if bn else []
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), *norm, nn.ReLU()) for _ in range(8)], nn.Linear(64, 4))


def _device(args: argparse.Namespace) -> torch.device:
    return torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")


def _ddp(args: argparse.Namespace) -> DDP:
    device = _device(args)
    ids = [0] if device.type == "cuda" else None
    return DDP(_model(args.bn).to(device), device_ids=ids, bucket_cap_mb=0.02)


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    device = _device(args)
    return torch.randn(8, 64, device=device), torch.randn(8, 4, device=device)


def _sync(args: argparse.Namespace) -> None:
    """The bench's own wait for the GPU, around a timed block (never inside the steps)."""
    if args.device == "cuda":
        torch.cuda.synchronize()


def _instrument(ddp: DDP, args: argparse.Namespace) -> Any:
    """ddpdoctor on ``ddp`` as both passes and the side-by-side timing take it: a NullSink, the
    process sampler all but off, ``--check-every`` where given."""
    every = {} if args.check_every is None else {"check_every": args.check_every}
    return ddpdoctor.instrument(ddp, sink=NullSink(), proc_interval=1000, **every)


def _side_by_side(args: argparse.Namespace) -> tuple[float, float]:
    """What instrumenting adds to a whole step, cold caches and all, with no timer anywhere: the
    same model plain and instrumented (two DDP instances, one process group), timed in
    alternating blocks. Returns (plain µs/step, median over the pairs of instrumented - plain).

    The instrumented monitor's optimizer hooks are process-wide, so the plain blocks pay for them
    too (two C++ calls a step, well under a microsecond): the difference leaves them out."""
    x, y = _batch(args)
    plain = _ddp(args)
    watched = _ddp(args)
    monitor = _instrument(watched, args)

    def block(ddp: DDP, opt: torch.optim.Optimizer, steps: int) -> float:
        _sync(args)
        start = time.perf_counter()
        for _ in range(steps):
            loss = ((ddp(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        _sync(args)
        return (time.perf_counter() - start) / steps * 1e6

    opts = {id(d): torch.optim.SGD(d.parameters(), lr=0.01) for d in (plain, watched)}
    for ddp in (plain, watched):
        block(ddp, opts[id(ddp)], 100)
    plains, diffs = [], []
    for i in range(args.pairs):
        order = (plain, watched) if i % 2 == 0 else (watched, plain)
        times = {id(ddp): block(ddp, opts[id(ddp)], args.block) for ddp in order}
        plains.append(times[id(plain)])
        diffs.append(times[id(watched)] - times[id(plain)])
    monitor.close()
    return statistics.median(plains), statistics.median(diffs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--bn", action="store_true", help="BatchNorm between the layers (buffers broadcast)")
    parser.add_argument(
        "--route", choices=("native", "python"), default="native", help="how buckets are timed (default: native)"
    )
    parser.add_argument(
        "--pairs", type=int, default=10, help="pairs of plain and instrumented blocks timed side by side (0: none)"
    )
    parser.add_argument("--block", type=int, default=200, help="steps per block of the side-by-side timing")
    parser.add_argument(
        "--check-every",
        type=int,
        default=None,
        help="the sampled checks' interval (default: the product's); a large one leaves the routine steps alone",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: NCCL, world size 1, CUDA-event marks",
    )
    args = parser.parse_args()
    if args.device == "cuda":
        args.route = "python"  # CUDA models take the Python route: their marks are CUDA events
        torch.cuda.set_device(0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
    else:
        os.environ["DDPDOCTOR_NATIVE"] = "1" if args.route == "native" else "0"
        init_gloo(0, 1, free_port())
    ab = _side_by_side(args) if args.pairs else None
    # the top-level entry points are wrapped before instrument: some are bound at registration
    for owner, name, label, _ in TOP:
        _wrap(owner, name, label)
    ddp = _ddp(args)
    monitor = _instrument(ddp, args)
    header = monitor.attachment.header
    assert header is not None and header.timing == args.route, "the native hook did not load: see the warning"
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = _batch(args)

    def step() -> None:
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def timed_pass() -> tuple[dict[str, int], float, float]:
        TOTALS.clear()
        for calls in CALLS.values():
            calls.clear()
        own = monitor.own_ns
        _sync(args)
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        _sync(args)
        wall_us = (time.perf_counter() - start) / args.steps * 1e6
        return dict(TOTALS), wall_us, (monitor.own_ns - own) / args.steps / 1000

    for _ in range(100):
        step()
    top, wall_us, own_us = timed_pass()
    medians = {label: statistics.median(calls) / 1000 for label, calls in CALLS.items() if calls}
    for owner, name, label, _ in NESTED:
        _wrap(owner, name, label)
    if args.device == "cuda":
        for owner, name, label in CUDA_ROWS:
            _wrap(owner, name, label)
    nested, _, _ = timed_pass()
    buckets = max(1, len(monitor.recorder.layout_bytes()))
    monitor.close()

    def per_step(totals: dict[str, int], label: str) -> float:
        return float(totals.get(label, 0) / args.steps / 1000)

    print(
        f"{args.device}, {args.route} route: step {wall_us:.0f} µs (instrumented, timers included), {buckets} buckets, "
        f"{args.steps} steps per pass"
    )
    for _, _, label, _ in TOP:
        print(f"  {label:40s} {per_step(top, label):7.1f} µs/step")
        for _, _, inner, parent in NESTED:
            if parent == label:
                print(f"  {inner:40s} {per_step(nested, inner):7.1f} µs/step  (pass 2)")
    if args.device == "cuda":
        print("  (the CUDA clock, inside the rows above)")
        for _, _, label in CUDA_ROWS:
            print(f"  {label:40s} {per_step(nested, label):7.1f} µs/step  (pass 2)")
    sums = {where: sum(per_step(top, label) for _, _, label, w in TOP if w == where) for where in ("step", "bucket")}
    gloo = sum(per_step(top, label) for _, _, label, w in TOP if w == "gloo")
    print(f"training thread, per step (forward hooks, backward end, optimizer): {sums['step']:.1f} µs")
    sampled = sum(per_step(top, label) for _, _, label, w in TOP if w == "sampled")
    print(f"training thread, the fingerprint hook of the sampled steps, amortized per step: {sampled:.1f} µs")
    print(f"training thread, per step with the fingerprints (the goal's figure): {sums['step'] + sampled:.1f} µs")
    print(f"training thread, per bucket (ready, launched): {sums['bucket'] / buckets:.1f} µs")
    print(f"gloo's thread, per bucket (done): {gloo / buckets:.1f} µs")
    print(f"Monitor.own_us per step (its own accounting, pass 1): {own_us:.1f} µs")
    routine = sum(medians.get(label, 0.0) for _, _, label, w in TOP if w == "step")
    print(f"training thread, the median call of each per-step entry point, summed (a routine step): {routine:.1f} µs")
    if ab is not None:
        plain_us, added_us = ab
        print(
            f"step time, plain vs instrumented side by side (no timers; {args.pairs} pairs of {args.block} steps): "
            f"plain {plain_us:.0f} µs, instrumented +{added_us:.1f} µs/step (median of the pairs' differences)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
