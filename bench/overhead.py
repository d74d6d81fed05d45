"""Step-time overhead of ddpdoctor vs torch.profiler vs TORCH_DISTRIBUTED_DEBUG.

Two gloo ranks on CPU train two small models built here (no torchvision):

* ``long``: a conv stack with BatchNorm (buffers broadcast every step), >= 50 ms/step;
* ``short``: a tiny MLP (one BatchNorm1d) with small buckets, <= 5 ms/step.

How the figures are taken. The machine this was written for is a 2-vCPU VM whose CPU capacity
changes by up to 2x from one few-second stretch to the next, so everything is interleaved at
the granularity of short *rounds*:

* A round builds a fresh model (same seeds) and a fresh DDP wrapper, runs warm-up steps, then N
  timed steps. Each step is timed on the host with ``time.perf_counter`` around the whole step
  (forward, loss, zero_grad, backward, optimizer). After the round the ranks exchange their step
  times (outside the timed loop); a step's time is the max over ranks and the round's value is
  the median over its steps (the mean is kept too).
* Several 2-rank process groups live side by side and take turns; only one runs at a time, the
  others block on a queue (idle). ``main`` runs plain, ddpdoctor and torch.profiler rounds
  (and the ``--attribution`` ones). ``TORCH_DISTRIBUTED_DEBUG`` is read when
  ``torch.distributed`` is imported and applied when a process group is created, so each debug
  setting has its own group, started with the variable set, and its baseline is ``envplain``, a
  group started identically without it.
* Every tool round runs right before or after its own plain round (order alternating), in a
  schedule that rotates tools and models pair by pair. Overhead of a tool = median over pairs of
  (tool round / its plain round - 1). A "plain vs plain" row measures the same way what a tool
  that does nothing would show: the noise floor of the run.
* ddpdoctor rounds call ``ddpdoctor.instrument(ddp, run_dir=<temp dir>)`` (default file sink and
  options) right after building DDP and ``close()`` the monitor after the round (not timed); the
  round fails unless the monitor recorded every step, wrote its file and kept all probes on.
  Profiler rounds run warm-up and timed steps inside
  ``torch.profiler.profile(activities=[ProfilerActivity.CPU])``; its post-processing is not timed.
* DETAIL is started as users set it; if its ranks crash (they do with gloo in torch 2.13.0+cpu:
  segfault in DDP's constructor), the crash is reported and DETAIL set with
  ``dist.set_debug_level`` right after ``init_process_group`` is measured instead (DDP, reducer
  and logger in DETAIL; the group is not wrapped in ProcessGroupWrapper, so this leaves out the
  wrapper's per-collective checks: a lower bound).

* The ``ddpdoctor`` row takes ddpdoctor's default route: the native C++ comm hook when it builds
  (built by ``main`` before the ranks start; a round fails if it took another route), else the
  Python comm hook. ``--routes`` adds ddpdoctor on the Python route (``DDPDOCTOR_NATIVE=0``),
  plain DDP with the native hook alone (ring never drained) and plain DDP with a minimal Python
  hook: native vs Python route vs plain, side by side.

* ``--against TREE`` adds a row that times ddpdoctor from this tree against ddpdoctor from TREE
  (another checkout, e.g. ``git archive <commit> | tar -x -C TREE``, its native hook built there
  with ``python -m ddpdoctor.runtime.native``): a process group whose ranks import ddpdoctor from
  TREE, each of its rounds paired with one of this tree's. Its rounds run in another group than
  this tree's, so a ``--against`` of this very tree measures what two groups differ by (their
  noise row). Measured for the non-finite gradient check (native route, bucket check folded into
  the scaling pass), short model, 13 pairs each, on the 2-core VM with a load average of 8-12
  (other jobs running): this tree vs the tree before the check +12.8% (quartiles -12.5% ..
  +37.4%), this tree vs itself +0.6% (quartiles -15.3% .. +18.0%), plain vs plain -0.9% and
  -8.7% (quartiles up to +-20%): the check is below what such a host resolves. ``bench/hot_path.py``
  on the same host, ddpdoctor's own time per routine step on the training thread: 20.4 and
  23.9 µs before, 17.3 and 22.4 µs after (two runs each, alternating).

Usage: ``python bench/overhead.py [--against TREE] [--pairs 7] [--steps 10] [--attribution] [--routes] [--model short]
[--no-profiler] [--no-debug-env] [--json FILE] [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: ``--against TREE``: the ranks of the group started with this set import ddpdoctor from TREE
#: (another checkout: the tree before a change), this script and its harness from this one.
AGAINST_ENV = "DDPDOCTOR_BENCH_AGAINST"
if os.environ.get(AGAINST_ENV):
    import importlib.util

    _package = Path(os.environ[AGAINST_ENV]) / "ddpdoctor"
    _spec = importlib.util.spec_from_file_location(
        "ddpdoctor", _package / "__init__.py", submodule_search_locations=[str(_package)]
    )
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["ddpdoctor"] = _module  # (its submodules are found under its own path from now on)
    _spec.loader.exec_module(_module)

from bench.harness import (
    Groups,
    RankFailure,
    init_gloo,
    pair_roles,
    paired_overheads,
    pct,
    python_allreduce_hook,
    rotated,
)

WORLD_SIZE = 2
#: ``DDPDOCTOR_NATIVE`` (read by ddpdoctor at instrument): ``0`` for the Python-route rounds.
NATIVE_ENV = "DDPDOCTOR_NATIVE"
#: The route the ddpdoctor rounds must have taken (set by ``main`` once the native hook is built).
EXPECT_TIMING_ENV = "DDPDOCTOR_BENCH_EXPECT_TIMING"
DEBUG_ENV = "TORCH_DISTRIBUTED_DEBUG"
#: Pseudo debug setting: DETAIL set with ``dist.set_debug_level`` *after* ``init_process_group``.
NOWRAP = "DETAIL-nowrap"

# -- models ------------------------------------------------------------------------------------


def long_model() -> nn.Module:
    """Conv stack with BatchNorm: ~0.17 M parameters, >= 50 ms/step on one CPU thread."""
    w = 32
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1),
        nn.BatchNorm2d(w),
        nn.ReLU(),
        nn.Conv2d(w, w, 3, padding=1),
        nn.BatchNorm2d(w),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1),
        nn.BatchNorm2d(2 * w),
        nn.ReLU(),
        nn.Conv2d(2 * w, 2 * w, 3, padding=1),
        nn.BatchNorm2d(2 * w),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1),
        nn.BatchNorm2d(4 * w),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * w, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def short_model() -> nn.Module:
    """Tiny MLP with one BatchNorm1d: a few ms/step, several small buckets."""
    h = 128
    return nn.Sequential(
        nn.Linear(64, h),
        nn.BatchNorm1d(h),
        nn.ReLU(),
        nn.Linear(h, h),
        nn.ReLU(),
        nn.Linear(h, h),
        nn.ReLU(),
        nn.Linear(h, h),
        nn.ReLU(),
        nn.Linear(h, 10),
    )


@dataclass(frozen=True)
class Spec:
    name: str
    build: Any
    input_shape: tuple[int, ...]
    bucket_cap_mb: float
    batch: int = 32


SPECS = {
    "long": Spec("long", long_model, (3, 32, 32), bucket_cap_mb=0.25),
    "short": Spec("short", short_model, (64,), bucket_cap_mb=0.05),
}

# -- one rank ----------------------------------------------------------------------------------


class CpuClock:
    """CPU time this process spent over the timed steps, split by thread: the training (main)
    thread, ddpdoctor's threads (named ``ddpdoctor-*``) and the rest (gloo's and torch's native
    threads, where the native comm hook's completion callback also runs).

    CPU time does not count the time a thread waits (for a peer, for a core the VM gave elsewhere),
    so on a noisy machine it attributes what wall-clock pairs cannot: the work each thread did. It
    misses what ddpdoctor costs torch's own work (caches it evicts, a GIL hand-off's wait)."""

    def __init__(self) -> None:
        self._start: dict[str, int] = {}

    @staticmethod
    def now() -> dict[str, int]:
        """CPU ns so far: the process's, the main thread's and ddpdoctor's threads' (``ours``)."""
        by = {"process": time.process_time_ns(), "main": 0, "ours": 0}
        for t in threading.enumerate():
            if t.ident is None or not t.is_alive():
                continue
            if t is threading.main_thread():
                key = "main"
            elif t.name.startswith("ddpdoctor"):
                key = "ours"
            else:
                continue
            try:
                by[key] += time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
            except OSError:  # the thread ended between enumerate and here
                pass
        return by

    def start(self) -> None:
        self._start = self.now()

    def per_step_us(self, steps: int) -> dict[str, float]:
        """µs of CPU per timed step: process, main, ddpdoctor threads, rest (process - the two).

        A ddpdoctor thread started during the steps counts from its start (its CPU before the
        first timed step is not subtracted), which is what it cost."""
        if not self._start or steps <= 0:
            return {}
        end = self.now()
        d = {k: (end[k] - self._start.get(k, 0)) / 1e3 / steps for k in end}
        d["rest"] = d["process"] - d["main"] - d["ours"]
        return d


def _batches(spec: Spec, rank: int, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(spec.batch, *spec.input_shape, generator=gen), torch.randint(0, 10, (spec.batch,), generator=gen))
        for _ in range(n)
    ]


def build_training(
    spec: Spec, rank: int
) -> tuple[
    nn.parallel.DistributedDataParallel, torch.optim.SGD, nn.CrossEntropyLoss, list[tuple[torch.Tensor, torch.Tensor]]
]:
    """The benches' training of ``spec`` on this rank (its process group up): the model from seed
    0 in a DDP of the spec's buckets, SGD with momentum, cross-entropy and the rank's batches. Every
    bench that compares runs builds it the same way, so their losses can be compared bit for bit."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(spec.build(), bucket_cap_mb=spec.bucket_cap_mb)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    return ddp, optimizer, nn.CrossEntropyLoss(), _batches(spec, rank)


def _run_round(
    rank: int, spec: Spec, mode: str, warmup: int, steps: int, run_dir: str, verify: bool = False
) -> dict[str, Any]:
    """One round on this rank: fresh model and DDP, warm-up, timed steps. Returns this rank's view."""
    import ddpdoctor

    gc.collect()
    ddp, optimizer, loss_fn, batches = build_training(spec, rank)
    monitor = None
    if mode in ("ddpdoctor", "nullsink"):
        from ddpdoctor.sinks import NullSink

        if mode == "ddpdoctor":
            monitor = ddpdoctor.instrument(ddp, run_dir=run_dir)
        else:  # attribution only: every probe, records dropped instead of written
            monitor = ddpdoctor.instrument(ddp, sink=NullSink())
        if not isinstance(monitor, ddpdoctor.Monitor):
            raise RuntimeError("ddpdoctor.instrument did not attach (returned a disabled monitor)")
    elif mode == "pyroute":  # routes only: ddpdoctor with its Python comm hook (the native one off)
        os.environ[NATIVE_ENV] = "0"
        try:
            monitor = ddpdoctor.instrument(ddp, run_dir=run_dir)
        finally:
            del os.environ[NATIVE_ENV]
        if not isinstance(monitor, ddpdoctor.Monitor):
            raise RuntimeError("ddpdoctor.instrument did not attach (returned a disabled monitor)")
    elif mode == "pyhook":  # attribution only: DDP's allreduce done by a minimal Python comm hook
        ddp.register_comm_hook(ddp.process_group, python_allreduce_hook)
    elif mode == "nativehook":  # routes only: ddpdoctor's C++ timed hook alone, its ring never drained
        from ddpdoctor.runtime.step import native_hook

        native_hook.load().register_timed_hook(ddp.reducer, ddp.process_group, native_hook.RING_CAPACITY)
    profiler = None
    ctx: Any = contextlib.nullcontext()
    if mode == "profiler":
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        ctx = profiler
    times: list[float] = []
    losses: list[float] = []
    cpu = CpuClock()
    dist.barrier()
    perf = time.perf_counter
    with ctx:
        for i in range(warmup + steps):
            if i == warmup:
                cpu.start()
            x, y = batches[i % len(batches)]
            t0 = perf()
            loss = loss_fn(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            t1 = perf()
            if i >= warmup:
                times.append(t1 - t0)
            if i == 0 or i == warmup + steps - 1:
                losses.append(float(loss.detach()))
    out: dict[str, Any] = {"times": times, "losses": losses, "cpu_us": cpu.per_step_us(steps)}
    try:
        logged = ddp._get_ddp_logging_data()
        sizes = str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes") or "")
        out["buckets"] = len([s for s in sizes.split(",") if s.strip()])
    except Exception:  # noqa: BLE001 - a private torch API: the bucket count is informative only
        out["buckets"] = None
    if monitor is not None:
        out["timing"] = monitor.attachment.header.timing
        expected = "python" if mode == "pyroute" else os.environ.get(EXPECT_TIMING_ENV, "")
        if expected and out["timing"] != expected:
            raise RuntimeError(f"ddpdoctor round timed buckets with the {out['timing']} route, not {expected}")
        steps_before_close = monitor.steps
        probes_off = [name for name, on in monitor.probes.on.items() if not on]
        monitor.close()
        path = monitor.path
        size = path.stat().st_size if path is not None and path.exists() else 0
        if (
            steps_before_close <= 0
            or monitor.steps < warmup + steps
            or probes_off
            or (mode == "ddpdoctor" and size == 0)
        ):
            raise RuntimeError(
                f"ddpdoctor round was not really instrumented: steps before close={steps_before_close}, "
                f"after={monitor.steps}, log={path} ({size} bytes), probes off={probes_off}"
            )
        out["monitor_steps"] = monitor.steps
        out["log_bytes"] = size
    if profiler is not None and verify:  # once per model: the profiler really recorded the steps
        names = {e.key for e in profiler.key_averages()}
        if "aten::addmm" not in names and "aten::convolution" not in names:
            raise RuntimeError(f"torch.profiler recorded no model ops ({len(names)} keys)")
        out["profiler_keys"] = len(names)
    return out


def rank_worker(rank: int, group: str, port: int, commands: Any, done: Any, debug: str | None) -> None:
    """One rank of one process group (``harness.Groups``): runs the rounds it is sent until None."""
    try:
        init_gloo(rank, WORLD_SIZE, port)
        if debug == NOWRAP:
            # DETAIL for DDP, its reducer and logger; the default group, created before, is not
            # wrapped in ProcessGroupWrapper.
            dist.set_debug_level(dist.DebugLevel.DETAIL)
        level = str(dist.get_debug_level()).rsplit(".", 1)[-1]
        expected = "DETAIL" if debug == NOWRAP else (debug or "OFF")
        if level != expected:
            raise RuntimeError(f"debug level is {level}, expected {expected}")
        done.put(("ready", group, rank, level))
        while True:
            entry = commands.get()
            if entry is None:
                break
            spec = SPECS[entry["model"]]
            mine = _run_round(
                rank,
                spec,
                entry["mode"],
                entry["warmup"],
                entry["steps"],
                entry["run_dir"],
                verify=entry.get("verify", False) and rank == 0,
            )
            gathered: list[Any] = [None] * WORLD_SIZE
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                per_step_max = [max(ts) for ts in zip(*(g["times"] for g in gathered), strict=True)]
                done.put(
                    (
                        "result",
                        group,
                        rank,
                        {
                            **{k: v for k, v in entry.items() if k not in ("run_dir", "verify")},
                            "group": group,
                            "debug": level,
                            "step_ms": statistics.median(per_step_max) * 1e3,
                            "mean_ms": statistics.fmean(per_step_max) * 1e3,
                            "rank_median_ms": [statistics.median(g["times"]) * 1e3 for g in gathered],
                            # µs of CPU per step, per rank (averaged over the ranks)
                            "cpu_us": {
                                k: statistics.fmean(g["cpu_us"][k] for g in gathered) for k in gathered[0]["cpu_us"]
                            },
                            "buckets": gathered[0]["buckets"],
                            "losses": gathered[0]["losses"],
                            "monitor_steps": gathered[0].get("monitor_steps"),
                            "log_bytes": gathered[0].get("log_bytes"),
                        },
                    )
                )
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, then this rank exits 1
        text = traceback.format_exc()
        print(f"[group {group} rank {rank}] {text}", file=sys.stderr, flush=True)
        done.put(("error", group, rank, text))
        done.close()
        done.join_thread()  # os._exit would drop what the queue's feeder thread has not sent yet
        os._exit(1)
    # torch 2.13's gloo process group sometimes aborts in its destructors at interpreter teardown
    # ("terminate called without an active exception", with or without ddpdoctor). Everything is
    # reported and every monitor closed by now, so leave without running them.
    done.close()
    done.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the parent --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    key: str
    label: str
    group: str
    mode: str
    base_group: str
    base_mode: str = "plain"  # what the base round runs ("ddpdoctor" for ``--against``: tree vs tree)


def summarize(results: list[dict[str, Any]], models: list[str], tools: list[Tool]) -> dict[str, Any]:
    """Per model and tool: median plain ms, median tool ms, overheads of the pairs."""
    by = {(r["tool"], r["model"], r["pair"], r["role"]): r for r in results}
    summary: dict[str, Any] = {}
    for model in models:
        for tool in tools:
            pairs = sorted({r["pair"] for r in results if r["tool"] == tool.key and r["model"] == model})
            pairs = [p for p in pairs if (tool.key, model, p, "base") in by and (tool.key, model, p, "tool") in by]
            if not pairs:
                continue
            base = [by[(tool.key, model, p, "base")] for p in pairs]
            with_tool = [by[(tool.key, model, p, "tool")] for p in pairs]
            of_medians = paired_overheads([b["step_ms"] for b in base], [t["step_ms"] for t in with_tool])
            of_means = paired_overheads([b["mean_ms"] for b in base], [t["mean_ms"] for t in with_tool])
            summary[f"{model}/{tool.key}"] = {
                "plain_ms": statistics.median(b["step_ms"] for b in base),
                "tool_ms": statistics.median(t["step_ms"] for t in with_tool),
                **of_medians,
                "overhead_of_means": of_means["overhead"],
                "cpu": _cpu_deltas(base, with_tool),
            }
    return summary


def _cpu_deltas(base: list[dict[str, Any]], with_tool: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per CPU account (process, main, ours: ddpdoctor's threads, rest): the plain round's µs/step (median) and
    the median over pairs of the tool round's minus its plain round's."""
    out: dict[str, dict[str, float]] = {}
    for key in ("process", "main", "ours", "rest"):
        pairs = [(b["cpu_us"][key], t["cpu_us"][key]) for b, t in zip(base, with_tool, strict=True)]
        out[key] = {
            "plain": statistics.median(b for b, _ in pairs),
            "delta": statistics.median(t - b for b, t in pairs),
        }
    return out


def cpu_table(summary: dict[str, Any], models: list[str], tools: list[Tool], failed: dict[str, str]) -> str:
    """CPU µs per step per rank: the plain rounds', and what each tool added (median of pairs)."""
    lines = [
        "| model | tool | process: plain µs/step | + tool | main thread: plain | + tool "
        "| ddpdoctor threads: + tool | other threads: plain | + tool |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model in models:
        for tool in tools:
            s = summary.get(f"{model}/{tool.key}")
            if tool.key in failed or s is None:
                continue
            c = s["cpu"]
            lines.append(
                f"| {model} | {tool.label} | {c['process']['plain']:.0f} | {c['process']['delta']:+.0f} | "
                f"{c['main']['plain']:.0f} | {c['main']['delta']:+.0f} | {c['ours']['delta']:+.0f} | "
                f"{c['rest']['plain']:.0f} | {c['rest']['delta']:+.0f} |"
            )
    return "\n".join(lines)


def table(
    summary: dict[str, Any], models: list[str], tools: list[Tool], info: dict[str, str], failed: dict[str, str]
) -> str:
    lines = [
        (
            "| model | tool | plain ms/step | with tool ms/step | overhead (median of pairs) "
            "| pairs: quartiles [min … max] | overhead of per-round means |"
        ),
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for model in models:
        for tool in tools:
            s = summary.get(f"{model}/{tool.key}")
            if tool.key in failed or s is None:
                why = failed.get(tool.key, "no result")
                lines.append(f"| {model} ({info[model]}) | {tool.label} | – | – | **{why}** | – | – |")
                continue
            lines.append(
                f"| {model} ({info[model]}) | {tool.label} | {s['plain_ms']:.2f} | {s['tool_ms']:.2f} | "
                f"**{pct(s['overhead'])}** | {pct(s['q1'])} … {pct(s['q3'])} "
                f"[{pct(s['min'])} … {pct(s['max'])}] (n={s['pairs']}) | {pct(s['overhead_of_means'])} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=7, help="interleaved pairs per tool and model (default 7)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round, long model (default 10)")
    parser.add_argument(
        "--short-steps", type=int, default=None, help="timed steps per round, short model (default 20 x --steps)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps per round, long model (default 4; short model: 20)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (< 60 s)")
    parser.add_argument(
        "--attribution",
        action="store_true",
        help="also time plain DDP with a minimal Python allreduce comm hook (the floor of any "
        "Python comm hook) and ddpdoctor with a NullSink (all probes, no writer, no file)",
    )
    parser.add_argument(
        "--routes",
        action="store_true",
        help="also time ddpdoctor on its Python comm hook route (DDPDOCTOR_NATIVE=0), plain DDP with "
        "ddpdoctor's native C++ timed hook alone, and plain DDP with a minimal Python comm hook "
        "(the default ddpdoctor row takes the native route when it builds)",
    )
    parser.add_argument("--model", choices=["long", "short"], default=None, help="time one model only")
    parser.add_argument("--no-profiler", action="store_true", help="skip the torch.profiler rows")
    parser.add_argument("--no-debug-env", action="store_true", help="skip the TORCH_DISTRIBUTED_DEBUG groups")
    parser.add_argument("--json", default=None, help="write the raw per-round results here")
    parser.add_argument(
        "--against",
        default=None,
        metavar="TREE",
        help="also time ddpdoctor from this tree against ddpdoctor from TREE (another checkout, its native "
        "hook built there: python -m ddpdoctor.runtime.native), each round paired with the other",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.steps = 1, 3
        short_steps = args.short_steps or 40
        warm_long, warm_short = args.warmup or 2, 10
    else:
        short_steps = args.short_steps or 20 * args.steps
        # >= 4 keeps ddpdoctor's start-up samples (steps 0, 1 and 3) out of the timed steps
        warm_long = args.warmup if args.warmup is not None else 4
        warm_short = 20
    plan = {"long": (warm_long, args.steps), "short": (warm_short, short_steps)}
    models = [args.model] if args.model else list(SPECS)
    # the launcher pays the native hook's one-time build, not the timed ranks; the ddpdoctor
    # rounds must then take the native route
    from ddpdoctor.runtime.step import native_hook

    try:
        native_hook.build()
        os.environ[EXPECT_TIMING_ENV] = "native"
    except native_hook.NativeUnavailable as exc:
        print(
            f"[bench] native comm hook unavailable ({exc}): the ddpdoctor rows take the Python route", file=sys.stderr
        )
        os.environ[EXPECT_TIMING_ENV] = "python"

    tools = [
        # calibration: what a tool that does nothing measures here (the noise floor)
        Tool("null", "(calibration) plain vs plain", "main", "plain", "main"),
        Tool("ddpdoctor", "ddpdoctor.instrument (file sink)", "main", "ddpdoctor", "main"),
    ]
    if args.attribution or args.routes:
        tools.append(
            Tool("pyhook", "(attribution) plain DDP + minimal Python comm hook, no ddpdoctor", "main", "pyhook", "main")
        )
    if args.attribution:
        tools.append(Tool("nullsink", "(attribution) ddpdoctor.instrument with NullSink", "main", "nullsink", "main"))
    if args.routes:
        tools.append(
            Tool(
                "nativehook",
                "(routes) plain DDP + ddpdoctor's C++ timed hook, no ddpdoctor",
                "main",
                "nativehook",
                "main",
            )
        )
        tools.append(
            Tool("pyroute", "(routes) ddpdoctor.instrument, Python comm hook route", "main", "pyroute", "main")
        )
    if not args.no_profiler:
        tools.append(Tool("profiler", "torch.profiler (CPU activities)", "main", "profiler", "main"))
    detail = Tool("detail", "TORCH_DISTRIBUTED_DEBUG=DETAIL", "detail", "plain", "envplain")
    nowrap = Tool(
        "detail-nowrap",
        "DETAIL set after init_process_group (DDP side only, no ProcessGroupWrapper)",
        "nowrap",
        "plain",
        "envplain",
    )
    info_tool = Tool("info", "TORCH_DISTRIBUTED_DEBUG=INFO", "info", "plain", "envplain")

    if args.against:
        tools.append(
            Tool(
                "against",
                f"(trees) ddpdoctor, this tree vs {args.against}",
                "main",
                "ddpdoctor",
                "against",
                base_mode="ddpdoctor",
            )
        )
    workdir = tempfile.mkdtemp(prefix="ddpdoctor-bench-")
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    shown = list(tools)
    per_round_timeout = 300.0

    def log(message: str) -> None:
        print(f"[bench {time.monotonic() - started:5.0f} s] {message}", file=sys.stderr, flush=True)

    def warm(group: str) -> None:  # first round of a fresh process: lazy initialization, not timed
        for model in models:
            groups.run(
                group,
                {
                    "model": model,
                    "mode": "plain",
                    "warmup": 2,
                    "steps": 1,
                    "run_dir": "",
                    "tool": "-",
                    "role": "-",
                    "pair": -1,
                },
                per_round_timeout,
            )

    groups = Groups(rank_worker, WORLD_SIZE)

    def start(group: str, debug: str | None) -> None:
        # TORCH_DISTRIBUTED_DEBUG is read when the child imports torch.distributed
        groups.start(group, debug, env={DEBUG_ENV: None if debug in (None, NOWRAP) else debug})

    try:
        start("main", None)
        warm("main")
        if args.against:
            groups.start("against", None, env={AGAINST_ENV: str(Path(args.against).resolve())})
            warm("against")
        if not args.no_debug_env:
            start("envplain", None)
            warm("envplain")
            try:  # the real thing, as users set it
                start("detail", "DETAIL")
                warm("detail")
                tools.append(detail)
                shown.append(detail)
            except RankFailure as exc:
                failed["detail"] = f"crashed ({str(exc).splitlines()[0].split(': ', 1)[1]})"
                log(f"TORCH_DISTRIBUTED_DEBUG=DETAIL: {exc}; measuring DETAIL without the group wrapper instead")
                shown += [detail, nowrap]
                tools.append(nowrap)
                start("nowrap", NOWRAP)
                warm("nowrap")
            start("info", "INFO")
            warm("info")
            tools.append(info_tool)
            shown.append(info_tool)
        log(f"groups ready: {', '.join(groups.procs)}")

        schedule = []
        for pair in range(args.pairs):
            order_models = models if pair % 2 == 0 else models[::-1]
            for model in order_models:
                warmup, steps = plan[model]
                for k, tool in enumerate(rotated(tools, pair)):
                    for role in pair_roles(pair, k):
                        group = tool.base_group if role == "base" else tool.group
                        mode = tool.base_mode if role == "base" else tool.mode
                        schedule.append(
                            {
                                "tool": tool.key,
                                "role": role,
                                "group": group,
                                "model": model,
                                "mode": mode,
                                "pair": pair,
                                "warmup": warmup,
                                "steps": steps,
                                "verify": pair == 0 and mode == "profiler",
                                "run_dir": os.path.join(workdir, f"run-{model}-{tool.key}-{pair}"),
                            }
                        )
        log(f"{len(schedule)} rounds")
        for i, entry in enumerate(schedule):
            results.append(groups.run(entry["group"], entry, per_round_timeout))
            if (i + 1) % max(1, len(schedule) // 10) == 0:
                log(f"{i + 1}/{len(schedule)} rounds done")
    except Exception:  # noqa: BLE001 - any failure ends the bench with its traceback and exit 1
        traceback.print_exc()
        return 1
    finally:
        groups.close()
        shutil.rmtree(workdir, ignore_errors=True)

    # Same losses in every mode (the bench times what it claims to time).
    for model in models:
        losses = {json.dumps(r["losses"]) for r in results if r["model"] == model}
        if len(losses) != 1:
            log(f"note: {model}: first/last losses differ between rounds: {sorted(losses)}")

    summary = summarize(results, models, shown)
    info = {}
    for model in models:
        r = next(r for r in results if r["model"] == model)
        n_params = sum(p.numel() for p in SPECS[model].build().parameters())
        info[model] = f"{n_params / 1e3:.0f}k params, {r['buckets']} buckets, {plan[model][1]} steps/round"
    print(table(summary, models, shown, info, failed))
    print("\nCPU time per step and rank (µs; what each thread did, waits excluded):\n")
    print(cpu_table(summary, models, shown, failed))
    print(
        f"\n{WORLD_SIZE} gloo ranks on CPU, torch {torch.__version__}, 1 thread/rank, {os.cpu_count()} cores; "
        f"{args.pairs} pairs; warm-up {warm_long}/{warm_short} steps (long/short); "
        f"total {time.monotonic() - started:.0f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "failed": failed, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
