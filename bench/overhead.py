"""Step-time overhead of ddpdoctor vs torch.profiler vs TORCH_DISTRIBUTED_DEBUG.

Two gloo ranks on CPU train two small models built here (no torchvision):

* ``long``: a conv stack with BatchNorm (buffers broadcast every step), >= 50 ms/step;
* ``short``: a tiny MLP (one BatchNorm1d) with small buckets, <= 5 ms/step.

How the figures are taken (the machine is small and noisy, so everything is interleaved):

* Each *round* builds a fresh model (same seeds) and a fresh DDP wrapper, runs warm-up steps,
  then N timed steps. Each step is timed on the host with ``time.perf_counter`` around the whole
  step (forward, loss, zero_grad, backward, optimizer). After the round the ranks exchange their
  step times (outside the timed loop); a step's time is the max over ranks and the round's value
  is the median over its steps. Rounds are short on purpose: the CPU capacity of a small VM
  changes from one minute to the next, and a pair must see the same conditions.
* Rounds with ddpdoctor or torch.profiler (and the ``--attribution`` ones) run in one process
  group, each right next to its own plain round (plain first or second, alternating).
  ddpdoctor rounds call ``ddpdoctor.instrument(ddp, run_dir=<temp dir>)`` (default file sink,
  default ``proc_interval``) right after building DDP and ``close()`` it after the round (outside
  the timed steps); the round fails unless the monitor recorded every step, wrote its file and
  kept all its probes on. Profiler rounds run warm-up and timed steps inside
  ``torch.profiler.profile(activities=[ProfilerActivity.CPU])``; its post-processing after the
  ``with`` block is not timed.
* ``TORCH_DISTRIBUTED_DEBUG`` is read when ``torch.distributed`` is imported and applied when a
  process group is created, so those modes cannot share a process group: each of their rounds
  runs in a fresh pair of processes, in rotating order with a fresh plain pair (their shared
  baseline). DETAIL is tried first as users set it; if the ranks crash (they do with gloo in
  torch 2.13.0+cpu), the crash is reported and DETAIL set with ``dist.set_debug_level`` right
  after ``init_process_group`` (DDP, reducer and logger in DETAIL, the group not wrapped in
  ProcessGroupWrapper) is measured instead, as a lower bound.
* Overhead of a tool = median over pairs of (tool round / its plain round - 1).

Usage: ``python bench/overhead.py [--pairs 7] [--steps 10] [--attribution] [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD_SIZE = 2
DEBUG_ENV = "TORCH_DISTRIBUTED_DEBUG"
#: Pseudo debug mode: DETAIL set with ``dist.set_debug_level`` *after* ``init_process_group``.
NOWRAP = "DETAIL-nowrap"
#: Fresh-process modes: mode name -> how the ranks are started (None: no debug variable).
ENV_DEBUG_MODES: dict[str, str | None] = {
    "plain": None,
    # What users set. With gloo, torch wraps the default group in ProcessGroupWrapper; in
    # torch 2.13.0+cpu DDP's constructor then segfaults (c10d::Logger::set_env_variables casts
    # the wrapper to ProcessGroupGloo). The bench tries it once and reports the crash.
    "detail": "DETAIL",
    # Fallback measured when "detail" crashes: DDP/reducer/logger in DETAIL, group not wrapped
    # (so it leaves out the wrapper's per-collective consistency checks: a lower bound).
    "detail-nowrap": NOWRAP,
    "info": "INFO",
}

# -- models ------------------------------------------------------------------------------------


def long_model() -> nn.Module:
    """Conv stack with BatchNorm: ~0.3 M parameters, >= 50 ms/step on one CPU thread."""
    w = 40
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(),
        nn.Conv2d(w, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(),
        nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.BatchNorm2d(4 * w), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(4 * w, 256), nn.ReLU(), nn.Linear(256, 10),
    )


def short_model() -> nn.Module:
    """Tiny MLP with one BatchNorm1d: a few ms/step, several small buckets."""
    h = 128
    return nn.Sequential(
        nn.Linear(64, h), nn.BatchNorm1d(h), nn.ReLU(),
        nn.Linear(h, h), nn.ReLU(),
        nn.Linear(h, h), nn.ReLU(),
        nn.Linear(h, h), nn.ReLU(),
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

# -- one rank ------------------------------------------------------------------------------


def _batches(spec: Spec, rank: int, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(spec.batch, *spec.input_shape, generator=gen), torch.randint(0, 10, (spec.batch,), generator=gen))
        for _ in range(n)
    ]


def _run_round(
    rank: int, spec: Spec, mode: str, warmup: int, steps: int, run_dir: str, verify: bool = False
) -> dict[str, Any]:
    """One round on this rank: fresh model and DDP, warm-up, timed steps. Returns this rank's view."""
    import ddpdoctor
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    gc.collect()
    torch.manual_seed(0)
    model = spec.build()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=spec.bucket_cap_mb)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    batches = _batches(spec, rank)
    monitor = None
    if mode in ("ddpdoctor", "nullsink"):
        from ddpdoctor.sinks import NullSink

        if mode == "ddpdoctor":
            monitor = ddpdoctor.instrument(ddp, run_dir=run_dir)
        else:  # attribution only: every probe, records dropped instead of written
            monitor = ddpdoctor.instrument(ddp, sink=NullSink())
        if not isinstance(monitor, ddpdoctor.Monitor):
            raise RuntimeError("ddpdoctor.instrument did not attach (returned a disabled monitor)")
    elif mode == "pyhook":  # attribution only: DDP's allreduce done by a Python comm hook
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    profiler = None
    ctx: Any = contextlib.nullcontext()
    if mode == "profiler":
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        ctx = profiler
    times: list[float] = []
    losses: list[float] = []
    dist.barrier()
    perf = time.perf_counter
    with ctx:
        for i in range(warmup + steps):
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
    out: dict[str, Any] = {"times": times, "losses": losses}
    try:
        logged = ddp._get_ddp_logging_data()
        sizes = str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes") or "")
        out["buckets"] = len([s for s in sizes.split(",") if s.strip()])
    except Exception:
        out["buckets"] = None
    if monitor is not None:
        steps_before_close = monitor.steps
        probes_off = [name for name, on in monitor.probes.on.items() if not on]
        monitor.close()
        path = monitor.path
        size = path.stat().st_size if path is not None and path.exists() else 0
        if steps_before_close <= 0 or monitor.steps < warmup + steps or probes_off or (
            mode == "ddpdoctor" and size == 0
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


def rank_main(rank: int, port: int, schedule: list[dict[str, Any]], result_path: str, debug: str | None) -> None:
    """One rank: runs ``schedule`` (a list of rounds) in one process group; rank 0 writes results."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
        timeout=timedelta(seconds=300),
    )
    try:
        if debug == NOWRAP:
            # DETAIL for DDP, its reducer and logger, set after the default group was created,
            # so that group is not wrapped in ProcessGroupWrapper (see ENV_DEBUG_MODES).
            dist.set_debug_level(dist.DebugLevel.DETAIL)
        level = str(dist.get_debug_level()).rsplit(".", 1)[-1]
        expected = "DETAIL" if debug == NOWRAP else (debug or "OFF")
        if level != expected:
            raise RuntimeError(f"debug level is {level}, expected {expected}")
        results = []
        for entry in schedule:
            spec = SPECS[entry["model"]]
            mine = _run_round(rank, spec, entry["mode"], entry["warmup"], entry["steps"], entry["run_dir"],
                              verify=entry["pair"] == 0 and rank == 0)
            gathered: list[Any] = [None] * WORLD_SIZE
            dist.all_gather_object(gathered, mine)
            per_step_max = [max(ts) for ts in zip(*(g["times"] for g in gathered))]
            results.append({
                **{k: v for k, v in entry.items() if k != "run_dir"},
                "debug": level,
                "step_ms": statistics.median(per_step_max) * 1e3,
                "rank_median_ms": [statistics.median(g["times"]) * 1e3 for g in gathered],
                "buckets": gathered[0]["buckets"],
                "losses": gathered[0]["losses"],
                "monitor_steps": gathered[0].get("monitor_steps"),
                "log_bytes": gathered[0].get("log_bytes"),
            })
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(results, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # torch 2.13's gloo process group sometimes aborts in its destructors at interpreter teardown
    # ("terminate called without an active exception", with or without ddpdoctor). The results
    # are on disk and every monitor is closed by now, so leave without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the parent --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankFailure(RuntimeError):
    def __init__(self, codes: list[int | None]) -> None:
        signals = {-11: "SIGSEGV", -6: "SIGABRT", -9: "SIGKILL"}
        names = [signals.get(c, str(c)) if c is not None else "?" for c in codes]
        super().__init__(f"ranks exited with {', '.join(names)}")
        self.codes = codes


def launch(schedule: list[dict[str, Any]], workdir: str, debug: str | None, timeout: float) -> list[dict[str, Any]]:
    """Run ``schedule`` on a fresh pair of gloo ranks; kill them on timeout or failure."""
    ctx = mp.get_context("spawn")
    result_path = tempfile.mktemp(suffix=".json", dir=workdir)
    port = _free_port()
    saved = os.environ.get(DEBUG_ENV)
    if debug is None or debug == NOWRAP:
        os.environ.pop(DEBUG_ENV, None)
    else:
        os.environ[DEBUG_ENV] = debug  # read by torch.distributed at import in the child
    procs = []
    try:
        for rank in range(WORLD_SIZE):
            p = ctx.Process(target=rank_main, args=(rank, port, schedule, result_path, debug), daemon=True)
            p.start()
            procs.append(p)
    finally:
        if saved is None:
            os.environ.pop(DEBUG_ENV, None)
        else:
            os.environ[DEBUG_ENV] = saved
    try:
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {timeout:.0f} s")
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # one rank failed: do not wait for the other to time out
            time.sleep(0.2)
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes):
            raise RankFailure(codes)
        with open(result_path) as f:
            return json.load(f)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def summarize(results: list[dict[str, Any]], models: list[str], tools: list[tuple[str, str, str]]) -> dict[str, Any]:
    """Per model and tool: median plain ms, median tool ms, overheads of the pairs."""
    # a plain round is the baseline of the tool named in "baseline_for" (None: of every tool in its group)
    by = {(r["group"], r["model"], r["mode"], r["pair"], r.get("baseline_for")): r for r in results}
    summary: dict[str, Any] = {}
    for model in models:
        for group, mode, _label in tools:
            base = mode if group == "main" else None
            pairs = sorted({r["pair"] for r in results if r["group"] == group and r["model"] == model})
            pairs = [p for p in pairs
                     if (group, model, mode, p, None) in by and (group, model, "plain", p, base) in by]
            if not pairs:
                continue
            plain = [by[(group, model, "plain", p, base)]["step_ms"] for p in pairs]
            tool = [by[(group, model, mode, p, None)]["step_ms"] for p in pairs]
            ratios = [t / b - 1 for t, b in zip(tool, plain)]
            summary[f"{model}/{mode}"] = {
                "plain_ms": statistics.median(plain), "tool_ms": statistics.median(tool),
                "overhead": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "pairs": len(ratios),
            }
    return summary


def table(summary: dict[str, Any], models: list[str], tools: list[tuple[str, str, str]], info: dict[str, Any],
          failed: dict[str, str]) -> str:
    lines = [
        "| model | tool | plain ms/step | with tool ms/step | overhead (median of pairs) | pairs: min … max |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model in models:
        for _group, mode, label in tools:
            s = summary.get(f"{model}/{mode}")
            if mode in failed or s is None:
                why = failed.get(mode, "no result")
                lines.append(f"| {model} ({info[model]}) | {label} | – | – | **{why}** | – |")
                continue
            lines.append(
                f"| {model} ({info[model]}) | {label} | {s['plain_ms']:.2f} | {s['tool_ms']:.2f} | "
                f"**{_pct(s['overhead'])}** | {_pct(s['min'])} … {_pct(s['max'])} (n={s['pairs']}) |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=7, help="interleaved pairs per tool and model (default 7)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round, long model (default 10)")
    parser.add_argument("--short-steps", type=int, default=None,
                        help="timed steps per round, short model (default 20 x --steps)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up steps per round, long model (default 3; short model: 20)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (< 60 s)")
    parser.add_argument("--attribution", action="store_true",
                        help="also time plain DDP with a Python allreduce comm hook (what ddpdoctor's hook wraps) "
                             "and ddpdoctor with a NullSink (all probes, no writer thread, no file)")
    parser.add_argument("--no-debug-env", action="store_true", help="skip the TORCH_DISTRIBUTED_DEBUG rounds")
    parser.add_argument("--json", default=None, help="write the raw per-round results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.steps = 1, 4
        short_steps = args.short_steps or 30
        warm_long, warm_short = args.warmup or 2, 10
    else:
        short_steps = args.short_steps or 20 * args.steps
        warm_long = args.warmup if args.warmup is not None else 3
        warm_short = 20
    plan = {"long": (warm_long, args.steps), "short": (warm_short, short_steps)}
    models = list(SPECS)

    tools: list[tuple[str, str, str]] = [("main", "ddpdoctor", "ddpdoctor.instrument (file sink)")]
    if args.attribution:
        tools.append(("main", "pyhook", "(attribution) plain DDP + Python allreduce_hook, no ddpdoctor"))
        tools.append(("main", "nullsink", "(attribution) ddpdoctor.instrument with NullSink"))
    tools.append(("main", "profiler", "torch.profiler (CPU activities)"))
    main_tools = [mode for group, mode, _ in tools if group == "main"]

    workdir = tempfile.mkdtemp(prefix="ddpdoctor-bench-")
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    failed: dict[str, str] = {}

    def log(message: str) -> None:
        print(f"[bench {time.monotonic() - started:5.0f} s] {message}", file=sys.stderr, flush=True)

    def fresh_schedule(mode: str, pair: int) -> list[dict[str, Any]]:
        return [{"group": "env", "model": model, "mode": mode, "pair": pair, "warmup": plan[model][0],
                 "steps": plan[model][1], "run_dir": ""} for model in models]

    per_launch = 600 + 60 * (1 + args.steps / 10)
    try:
        # plain / ddpdoctor / (pyhook) / profiler: interleaved rounds in one process group
        schedule = []
        for pair in range(args.pairs):
            for model in models:
                warmup, steps = plan[model]
                for k, tool in enumerate(main_tools):
                    # every tool round has its own plain round right before or after it
                    for mode in (("plain", tool) if (pair + k) % 2 == 0 else (tool, "plain")):
                        schedule.append({
                            "group": "main", "model": model, "mode": mode, "pair": pair, "warmup": warmup,
                            "steps": steps, "baseline_for": tool if mode == "plain" else None,
                            "run_dir": os.path.join(workdir, f"run-{model}-{mode}-{pair}"),
                        })
        log(f"main group: {len(schedule)} rounds in one process group")
        results += launch(schedule, workdir, None, 600 + 30 * len(schedule) * (1 + args.steps / 10))
        log("main group done")

        # TORCH_DISTRIBUTED_DEBUG: each round in fresh processes, alternating with plain ones
        if not args.no_debug_env:
            env_modes = ["detail", "info"]
            try:  # the real thing, as users set it
                results += launch(fresh_schedule("detail", 0), workdir, ENV_DEBUG_MODES["detail"], per_launch)
            except RankFailure as exc:
                failed["detail"] = f"crashed ({exc})"
                env_modes = ["detail-nowrap", "info"]
                log(f"TORCH_DISTRIBUTED_DEBUG=DETAIL: {exc}; measuring DETAIL without the group wrapper instead")
            for pair in range(args.pairs):
                kinds = ["plain"] + env_modes
                shift = pair % len(kinds)
                for mode in kinds[shift:] + kinds[:shift]:
                    if mode == "detail" and pair == 0:
                        continue  # already run above
                    results += launch(fresh_schedule(mode, pair), workdir, ENV_DEBUG_MODES[mode], per_launch)
                log(f"fresh-process pair {pair + 1}/{args.pairs} done")
            if "detail" in failed:
                tools.append(("env", "detail", "TORCH_DISTRIBUTED_DEBUG=DETAIL"))
                tools.append(("env", "detail-nowrap",
                              "DETAIL set after init_process_group (DDP side only, no ProcessGroupWrapper)"))
            else:
                tools.append(("env", "detail", "TORCH_DISTRIBUTED_DEBUG=DETAIL"))
            tools.append(("env", "info", "TORCH_DISTRIBUTED_DEBUG=INFO"))
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    # Same losses in every mode (the bench times what it claims to time).
    for model in models:
        losses = {json.dumps(r["losses"]) for r in results if r["model"] == model}
        if len(losses) != 1:
            log(f"note: {model}: first/last losses differ between modes: {sorted(losses)}")

    summary = summarize(results, models, tools)
    info = {}
    for model in models:
        r = next(r for r in results if r["model"] == model)
        n_params = sum(p.numel() for p in SPECS[model].build().parameters())
        info[model] = f"{n_params / 1e3:.0f}k params, {r['buckets']} buckets, {plan[model][1]} steps/round"
    print(table(summary, models, tools, info, failed))
    print(
        f"\n{WORLD_SIZE} gloo ranks on CPU, torch {torch.__version__}, 1 thread/rank, {os.cpu_count()} cores; "
        f"{args.pairs} pairs; warm-up {warm_long}/{warm_short} steps (long/short); total {time.monotonic() - started:.0f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "failed": failed, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
