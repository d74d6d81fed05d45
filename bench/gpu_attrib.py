"""Where ddpdoctor's step-time overhead on a GPU comes from: device time, host syncs, or the hook.

Same workloads and process group as ``bench/gpu_overhead.py`` (one GPU, NCCL, world size 1).
DDPs of one model side by side: plain, a second plain (the noise row), plain with a minimal
Python comm hook (the floor of timing buckets from Python; it scales every bucket, as at any
world size above 1), ddpdoctor (default: every bucket marked at the sampled steps only),
ddpdoctor with CUDA timing off (host marks: what the CUDA events themselves cost) and, on a GPU,
ddpdoctor with ``log="full"`` (every bucket of every step marked). After a warm-up, ``--pairs``
rounds of ``--steps`` steps each in a rotating order give each one's step time against plain
(median of the paired ratios), with the process's CPU time a step beside it (every thread: the
host work each one adds, against plain's). Then the profiler (CPU and CUDA activity) records
``--profile-steps`` steps of each, and a table lists per step: the kernels' device time, the
kernel count, and the host's CUDA runtime calls that wait for the device or add work
(synchronizations, event records and queries, host allocations).

``--events`` adds two more: the minimal Python hook recording two CUDA events per bucket (one
before the all-reduce, one in its callback, as ddpdoctor's full marks do), with timing enabled
and with timing disabled. Their difference is what timing events cost the device.

``--floor`` adds what the comm hook's floor is made of, for attribution only: the minimal hook
without its scale pass (at world size 1 the scale is 1.0, so it changes no bit there; at larger
sizes it would), and the minimal hook with NCCL's pre-multiplied sum instead of the scale pass (the
reduction scales as it sums; NCCL then cannot use its NVLink SHARP algorithm, which supports plain
sums only, so on NVSwitch machines it would change the algorithm, and with it the bits).

``--threads`` adds ddpdoctor with a NullSink (no writer thread) and ddpdoctor "quiet" (NullSink, no
hang watchdog, no process sampler rounds, no sampled checks after the first step): what its
threads (their GIL time, on the autograd thread's way) and its checks cost, apart from its hooks.

``--yappi N`` profiles N ddpdoctor steps on every Python thread; then the profiler table.

Last, the CUDA event calls on their own, 2,000 of each: ``Event.record()`` (which looks up the
current stream in Python), ``record(stream)`` with the stream given, ``query()``, ``elapsed_time``.
``--cprofile N`` then profiles N instrumented steps (ddpdoctor's and torch.cuda's functions).

    python bench/gpu_attrib.py [--model transformer|small] [--pairs 5] [--steps 20] [--events] [--cprofile 10]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_overhead import Contender
from bench.harness import first_value, free_port, pct, python_allreduce_hook

#: Host-side CUDA runtime calls worth counting (the profiler names them so on every version).
RUNTIME_CALLS = (
    "cudaDeviceSynchronize",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
    "cudaHostAlloc",
    "cudaFreeHost",
    "cudaEventRecord",
    "cudaEventRecordWithFlags",
    "cudaEventQuery",
    "cudaEventElapsedTime",
    "cudaStreamWaitEvent",
    "cudaLaunchKernel",
)


class EventHook:
    """A minimal Python comm hook that also records two CUDA events per bucket, as ddpdoctor's
    marks do (one before the all-reduce, one in its callback), and recycles them once passed:
    what the events themselves cost the device, without the rest of ddpdoctor."""

    def __init__(self, timing: bool | None, process_group: Any) -> None:
        self.timing = timing  # None: no events (a check of the hook where there is no GPU)
        self.process_group = process_group
        self.pool: list[Any] = []
        self.pending: list[Any] = []

    def mark(self) -> None:
        if self.timing is None:
            return
        ev = self.pool.pop() if self.pool else torch.cuda.Event(enable_timing=self.timing)
        ev.record()
        self.pending.append(ev)

    def __call__(self, bucket: Any) -> Any:
        process_group = self.process_group
        if bucket.index() == 0 and len(self.pending) > 400 and self.pending[-1].query():
            self.pool.extend(self.pending)
            self.pending.clear()
        self.mark()
        tensor = bucket.buffer()
        tensor.div_(process_group.size())

        def then(fut: Any) -> Any:
            self.mark()
            return fut.value()[0]

        return process_group.allreduce([tensor]).get_future().then(then)


def noscale_hook(process_group, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """The minimal hook without the scale pass (attribution only: bit-identical at world size 1)."""
    return process_group.allreduce([bucket.buffer()]).get_future().then(first_value)


def premul_hook(process_group, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """The minimal hook with NCCL's pre-multiplied sum: the scale done inside the reduction."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist._make_nccl_premul_sum(1.0 / process_group.size())
    return process_group.allreduce([bucket.buffer()], opts).get_future().then(first_value)


def _event_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    return state(bucket)


def contenders(
    model: str, device: torch.device, events: bool, floor: bool = False, threads: bool = False
) -> dict[str, Contender]:
    # plain-2: a second plain DDP, the noise row (what plain against plain reads on this machine)
    out = {n: Contender(model, False, device, False) for n in ("plain", "plain-2", "pyhook")}
    out["pyhook"].ddp.register_comm_hook(out["pyhook"].ddp.process_group, python_allreduce_hook)
    if floor:
        hooks = {"pyhook-noscale": noscale_hook}
        if device.type == "cuda":
            hooks["pyhook-premul"] = premul_hook
        for name, hook in hooks.items():
            c = out[name] = Contender(model, False, device, False)
            c.ddp.register_comm_hook(c.ddp.process_group, hook)
    if events:
        for timing in (True, False) if device.type == "cuda" else (None,):
            c = out[f"pyhook+events(timing={timing})"] = Contender(model, False, device, False)
            c.ddp.register_comm_hook(EventHook(timing, c.ddp.process_group), _event_hook)
    out["ddpdoctor"] = Contender(model, True, device, False)
    import ddpdoctor

    host = Contender(model, False, device, False)
    host.monitor = ddpdoctor.instrument(host.ddp, run_dir=host.tmp, cuda_timing=False)
    out["ddpdoctor-host-marks"] = host
    if threads:  # what ddpdoctor's threads and sampled checks cost, apart from its hooks
        from ddpdoctor.sinks.null import NullSink

        c = out["ddpdoctor-nullsink"] = Contender(model, False, device, False)
        c.monitor = ddpdoctor.instrument(c.ddp, sink=NullSink())  # no writer thread
        c = out["ddpdoctor-quiet"] = Contender(model, False, device, False)
        # no writer, no watchdog, no process sampler's rounds, no sampled checks after step 0
        c.monitor = ddpdoctor.instrument(c.ddp, sink=NullSink(), hang_timeout=0, proc_interval=1e9, check_every=10**9)
    if device.type == "cuda":  # every bucket of every step marked (the default: sampled steps only)
        full = Contender(model, False, device, False)
        full.monitor = ddpdoctor.instrument(full.ddp, run_dir=full.tmp, log="full")
        out["ddpdoctor-log-full"] = full
    return out


def profile(c: Contender, steps: int) -> dict[str, Any]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if c.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    c.sync()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            c.step()
        c.sync()
    kernels_us = 0.0
    kernels = 0
    calls: dict[str, tuple[int, float]] = {}
    top: dict[str, float] = {}
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0.0)
        if e.key in RUNTIME_CALLS:
            calls[e.key] = (e.count, e.cpu_time_total)
        elif dev and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels_us += dev
            kernels += e.count
            top[e.key] = dev
    return {"kernels_us": kernels_us / steps, "kernels": kernels / steps, "calls": calls, "top": top}


def event_costs(device: torch.device, n: int = 2000) -> list[str]:
    if device.type != "cuda":
        return ["(no GPU: event costs skipped)"]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    stream = torch.cuda.current_stream()
    rows = []
    perf = time.perf_counter_ns

    def timed(label: str, fn: Any) -> None:
        torch.cuda.synchronize()
        t0 = perf()
        for ev in events:
            fn(ev)
        rows.append(f"  {label:44s} {(perf() - t0) / n / 1000:7.2f} µs")

    timed("Event(enable_timing=True) (creation)", lambda ev: torch.cuda.Event(enable_timing=True))
    timed("torch.cuda.current_stream()", lambda ev: torch.cuda.current_stream())
    timed("torch._C._cuda_getCurrentStream(0)", lambda ev: torch._C._cuda_getCurrentStream(0))
    timed("ev.record()", lambda ev: ev.record())
    timed("ev.record(stream)", lambda ev: ev.record(stream))
    base = torch._C._CudaEventBase.record
    timed("_CudaEventBase.record(ev, stream)", lambda ev: base(ev, stream))
    torch.cuda.synchronize()
    timed("ev.query() (passed)", lambda ev: ev.query())
    first = events[0]
    timed("first.elapsed_time(ev)", lambda ev: first.elapsed_time(ev))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["transformer", "small"], default="transformer")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--events", action="store_true", help="add minimal hooks that record CUDA events")
    parser.add_argument("--only", nargs="+", default=None, help="keep these contenders only (plain is always kept)")
    parser.add_argument("--threads", action="store_true", help="add ddpdoctor without its threads and checks")
    parser.add_argument("--floor", action="store_true", help="add the comm hook's floor rows (no scale, premul)")
    parser.add_argument("--yappi", type=int, default=0, help="then profile N ddpdoctor steps, every thread (yappi)")
    parser.add_argument("--cprofile", type=int, default=0, help="then cProfile this many steps of ddpdoctor's")
    args = parser.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {args.model}, {what}")
    cs = contenders(args.model, device, args.events, args.floor, args.threads)
    if args.only:
        for name in [n for n in cs if n != "plain" and n not in args.only]:
            c = cs.pop(name)
            if c.monitor is not None:
                c.monitor.close()
    for c in cs.values():
        for _ in range(args.warmup):
            c.step()
    names = list(cs)
    times: dict[str, list[float]] = {n: [] for n in names}
    own: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}  # the process's CPU, every thread
    for p in range(args.pairs):
        order = names[p % len(names) :] + names[: p % len(names)]
        for n in order:
            r = cs[n].round(args.steps)
            times[n].append(r["step_ms"])
            own[n].append(r.get("own_us", 0.0))
            cpu[n].append(r["cpu_ms"])
    plain = times["plain"]
    base = [p.detach() for p in cs["plain"].ddp.parameters()]
    if device.type == "cuda":  # attention's backward and TF32 matmuls are not deterministic there
        print("(parameters not compared on a GPU: bench/real_jobs.py checks the bits, deterministic)")
        names_checked: list[str] = []
    else:
        names_checked = names
    for n in names_checked:
        # same seed, same inputs, same steps: a contender whose parameters differ from plain's by a
        # bit changed the gradients
        same = all(torch.equal(a, b.detach()) for a, b in zip(base, cs[n].ddp.parameters(), strict=True))
        print(f"{n:22s} parameters bit-identical to plain's: {'yes' if same else 'NO'}")
    for n in names:
        ratios = [t / b - 1.0 for t, b in zip(times[n], plain, strict=True)]
        print(
            f"{n:22s} {statistics.median(times[n]):8.3f} ms/step  vs plain {pct(statistics.median(ratios))}"
            f"  own {statistics.median(own[n]):7.1f} µs/step  process CPU {statistics.median(cpu[n]):8.3f} ms/step"
        )
    if args.yappi:  # before the profiler, whose post-processing of a transformer takes minutes
        yappi_profile(cs["ddpdoctor"], args.yappi)
    if args.profile_steps > 0:
        profile_table(cs, names, args.profile_steps)
    print("\nCUDA event calls, each:")
    print("\n".join(event_costs(device)))
    if args.cprofile:
        cprofile_steps(cs["ddpdoctor"], args.cprofile)
    for c in cs.values():
        if c.monitor is not None:
            c.monitor.close()
    dist.destroy_process_group()


def profile_table(cs: dict[str, Contender], names: list[str], steps: int) -> None:
    """Per step, each contender's device time and CUDA runtime calls, and its kernels beyond plain's."""
    print(f"\nper step, profiler over {steps} steps:")
    profiles = {n: profile(cs[n], steps) for n in names}
    for n in names:
        pr = profiles[n]
        calls = "  ".join(f"{k}={v[0] / steps:.1f}x/{v[1] / steps:.0f}us" for k, v in sorted(pr["calls"].items()))
        print(f"{n:22s} kernels {pr['kernels_us']:9.1f} µs ({pr['kernels']:.0f})  {calls}")
    base_top = profiles["plain"]["top"]
    for n in names[1:]:
        diff = sorted(((v - base_top.get(k, 0.0)) / steps, k) for k, v in profiles[n]["top"].items())
        extra = [f"{k[:60]} {d:+.1f}" for d, k in reversed(diff[-4:]) if d > 5]
        print(f"  {n}: kernels more than plain (µs/step): {'; '.join(extra) or 'none over 5 µs'}")


def cprofile_steps(c: Contender, steps: int) -> None:
    """cProfile of ``steps`` instrumented steps (the training thread only)."""
    import cProfile
    import pstats

    c.sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        c.step()
    prof.disable()
    c.sync()
    print(f"\ncProfile of {steps} ddpdoctor steps (training thread), by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats("ddpdoctor|cuda", 30)
    print("by cumulative time:")
    pstats.Stats(prof).sort_stats("cumulative").print_stats("ddpdoctor", 30)


def yappi_profile(c: Contender, steps: int) -> None:
    """CPU time of ddpdoctor's functions over ``steps`` steps, on every thread (on a GPU the
    backward and its comm hooks run on autograd's device thread, which cProfile does not see)."""
    yappi: Any = importlib.import_module("yappi")  # (a bench extra, where it is installed)

    yappi.set_clock_type("cpu")
    c.sync()
    yappi.start(builtins=True)
    for _ in range(steps):
        c.step()
    c.sync()
    yappi.stop()
    print(f"\nyappi, CPU time of {steps} ddpdoctor steps, every thread (µs a step):")
    for t in yappi.get_thread_stats():
        print(f"  thread {t.name:24s} {t.ttot * 1e6 / steps:9.1f}")
    funcs = yappi.get_func_stats(filter_callback=lambda f: "ddpdoctor" in f.module or "cuda" in f.module)
    for key in ("tsub", "ttot"):
        print(f"by {'own' if key == 'tsub' else 'cumulative'} time: calls a step, µs a step")
        for f in sorted(funcs, key=lambda f: getattr(f, key), reverse=True)[:28]:
            where = f"{Path(f.module).name}:{f.lineno} {f.name}"
            print(f"  {f.ncall / steps:7.1f} {getattr(f, key) * 1e6 / steps:9.1f}  {where}")


if __name__ == "__main__":
    main()
