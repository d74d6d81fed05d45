"""Step-time overhead of ddpdoctor with its rounds interleaved step by step: plain and instrumented
DDPs side by side in the same two gloo ranks, taking turns one step at a time.

Why another overhead bench. ``bench/overhead.py`` compares rounds of a few hundred steps run one
after the other; on this project's 2-core VM, whose CPU capacity moves by tens of percent from
one stretch of a second to the next, its plain-vs-plain row spreads by ±18% (quartiles) and the
short model's few percent cannot be read from it. Here the contenders' steps alternate within
milliseconds, so a slow stretch of the VM falls on all of them alike.

How the figures are taken. Two gloo ranks (``torch.multiprocessing``, one CPU thread each) build,
from the same seed, the same model several times over, each in its own DDP on the one process
group: ``plain`` (A), ``ddpdoctor`` (``ddpdoctor.instrument`` with its defaults, the file sink
into a temporary run dir), ``plain-2`` (B, the noise row) and, with ``--attribution``, plain DDP
with a minimal Python comm hook, plain DDP with ddpdoctor's C++ timed hook alone (its ring never
drained), plain DDP with a forward pre- and post-hook that do nothing (what any forward hook
costs: the module call's slow path), plain DDP with a forward pre-hook that runs 150 lines of
attribute arithmetic on an object of its own (``python-lines``: what Python lines cost that no
other code of the step runs, their code and data cold after the backward and optimizer step) and
ddpdoctor with a NullSink (no log writer). The models are built in ``--build-order``. After
``--warmup`` steps each, a *round* runs ``--block`` steps of every contender in turn, in an
order shuffled from round to round. Each step is timed on the host
(``perf_counter`` around forward, loss, ``zero_grad``, backward and the optimizer step), with the
training thread's CPU time (``thread_time``) and the process's (``process_time``, every thread)
around it; a step's wall time is the slower rank's (exchanged after the run, not during it).

* Rounds in which some contender's block took more than ``--hiccup`` (4) times that contender's
  median are left out for all contenders alike: the VM stalls a process for tens of ms now and
  then, and one stall outweighs a thousand steps' differences. The report counts them by who had
  the stall; ddpdoctor's own lumps (a sample: well under a ms) are far below the bar.
* **Overhead** of a contender = its total step time over the plain contender's total, minus 1
  (a ratio of means: ddpdoctor's work comes in lumps, a batch of records every 32 steps, a
  sample every 50, which a median of steps would leave out). The interval is a bootstrap over
  rounds (2.5th and 97.5th percentiles of 2,000 resamples). ``plain-2`` vs ``plain`` is what a
  tool that does nothing reads: the noise.
* **Training thread, + µs/step**: the same ratio of the training thread's CPU, in µs a step
  (CPU time leaves out the time a thread waits, for a peer or for a core the VM gave elsewhere).
* **ddpdoctor's threads**: their CPU time over the timed rounds (threads named ``ddpdoctor-*``,
  the log writer first), per instrumented step. They run while any contender steps, so the wall
  figures can miss part of them: a bound on what the wall figure leaves out, given apart.
* Every contender must end with the same losses as ``plain``, step for step (bit-identical: the
  same seed, data and all-reduce order), and the instrumented one must have recorded every step
  with every probe on and the native route where it was built.

Usage: ``python bench/interleaved.py [--model short|long] [--rounds 600] [--block 1]
[--warmup 60] [--attribution] [--hiccup 4] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import free_port, init_gloo, pct, python_allreduce_hook
from bench.overhead import SPECS, CpuClock, Spec, build_training

WORLD_SIZE = 2
#: the contenders' names; ``plain`` is every row's base (their order is shuffled every round)
BASE = "plain"
NOISE = "plain-2"
TOOL = "ddpdoctor"
ATTRIBUTION = ("python-hook", "native-hook", "empty-hooks", "python-lines", "nullsink")
#: lines of the ``python-lines`` row's hook: about what ddpdoctor's own hooks run a step
PYTHON_LINES = 150


def _nothing(*_: Any) -> None:
    return None


class _Fields:
    """Twenty attributes for the ``python-lines`` hook to read and write."""

    def __init__(self) -> None:
        for i in range(20):
            setattr(self, f"a{i}", i)


def _python_lines_hook(n: int) -> Any:
    """A forward pre-hook of ``n`` lines: reads, a sum and a write of an attribute, and tests of
    one, taking turns (``exec``: the lines are written out, not a loop)."""
    lines = ["def hook(module, args):", "    s = FIELDS"]
    for i in range(n):
        if i % 2:
            lines.append(f"    s.a{i % 20} = s.a{(i * 7) % 20} + {i}")
        else:
            lines.append(f"    if s.a{i % 20} < 0:\n        return None")
    namespace: dict[str, Any] = {"FIELDS": _Fields()}
    exec("\n".join(lines), namespace)  # (the bench's own generated code)
    return namespace["hook"]


class Contender:
    """One DDP of the model (plain, instrumented or with a hook), stepped a block at a time."""

    def __init__(self, name: str, spec: Spec, rank: int, run_dir: str) -> None:
        import ddpdoctor

        self.name = name
        self.ddp, self.opt, self.loss_fn, self.batches = build_training(spec, rank)
        self.monitor: Any = None
        if name in (TOOL, "nullsink"):
            from ddpdoctor.sinks import NullSink

            sink = {"sink": NullSink()} if name == "nullsink" else {"run_dir": run_dir}
            self.monitor = ddpdoctor.instrument(self.ddp, **sink)
            if not isinstance(self.monitor, ddpdoctor.Monitor):
                raise RuntimeError("ddpdoctor.instrument did not attach")
        elif name == "python-hook":
            self.ddp.register_comm_hook(self.ddp.process_group, python_allreduce_hook)
        elif name == "native-hook":
            from ddpdoctor.runtime.step import native_hook

            native_hook.load().register_timed_hook(self.ddp.reducer, self.ddp.process_group, native_hook.RING_CAPACITY)
        elif name == "empty-hooks":  # what any forward hook costs: the module call's slow path
            self.ddp.register_forward_pre_hook(_nothing)
            self.ddp.register_forward_hook(_nothing)
        elif name == "python-lines":
            self.ddp.register_forward_pre_hook(_python_lines_hook(PYTHON_LINES))
        self.steps = 0
        self.own_ns = 0  # ddpdoctor's own accounting over the timed blocks (Monitor.own_ns)
        self.wall: list[float] = []  # s per timed block
        self.thread: list[float] = []  # training thread CPU s per timed block
        self.process: list[float] = []  # process CPU s per timed block
        self.losses: list[float] = []

    def run(self, n: int, timed: bool) -> None:
        perf, tt, pt = time.perf_counter, time.thread_time, time.process_time
        ddp, opt, loss_fn, batches = self.ddp, self.opt, self.loss_fn, self.batches
        losses = []
        own0 = self.monitor.own_ns if self.monitor is not None else 0
        t0, c0, p0 = perf(), tt(), pt()
        for _ in range(n):
            x, y = batches[self.steps % len(batches)]
            loss = loss_fn(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            self.steps += 1
            losses.append(loss.detach())
        t1, c1, p1 = perf(), tt(), pt()
        self.losses.extend(float(v) for v in losses)  # (read after the clock: no sync inside)
        if timed:
            if self.monitor is not None:
                self.own_ns += self.monitor.own_ns - own0
            self.wall.append(t1 - t0)
            self.thread.append(c1 - c0)
            self.process.append(p1 - p0)

    def finish(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.monitor is not None:
            m = self.monitor
            out["own_ns"] = self.own_ns
            out["timing"] = m.attachment.header.timing
            out["probes_off"] = [k for k, on in m.probes.on.items() if not on]
            m.close()
            out["monitor_steps"] = m.steps
            out["log_bytes"] = m.path.stat().st_size if m.path is not None and m.path.exists() else 0
        return out


def _build_order(names: list[str], order: str) -> list[str]:
    """``names`` in the order their models are built: ``given``, ``reverse``, or the contenders'
    names, comma-separated, first built first (those not named follow in their given order)."""
    if order == "given":
        return list(names)
    if order == "reverse":
        return names[::-1]
    first = [n for n in order.split(",") if n]
    unknown = [n for n in first if n not in names]
    if unknown:
        raise ValueError(f"--build-order names no contender {unknown}; contenders: {names}")
    return first + [n for n in names if n not in first]


def rank_main(rank: int, port: int, args: dict[str, Any], results: Any) -> None:
    try:
        init_gloo(rank, WORLD_SIZE, port)
        spec = SPECS[args["model"]]
        run_dir = args["run_dir"]
        names = [BASE, TOOL, NOISE, *(ATTRIBUTION if args["attribution"] else ())]
        # built in --build-order: where each model's tensors land (their addresses, hence how
        # they share cache sets and pages) moves a plain DDP's step by about 1% here, and always
        # the same way for the same order; two orders, run for run, set that apart from the tool
        built = {name: Contender(name, spec, rank, run_dir) for name in args["built"]}  # (main's _build_order)
        contenders = [built[n] for n in names]
        for _ in range(args["warmup"]):  # interleaved too, past the sampled checks' dense start
            for c in contenders:
                c.run(1, False)
        order = list(range(len(contenders)))
        rng = random.Random(1234)  # the same orders on both ranks
        dist.barrier()
        ours0 = CpuClock.now()["ours"]
        for _ in range(args["rounds"]):
            rng.shuffle(order)
            for k in order:
                contenders[k].run(args["block"], True)
        ours = (CpuClock.now()["ours"] - ours0) / 1e9
        data = {
            c.name: {"wall": c.wall, "thread": c.thread, "process": c.process, "losses": c.losses, **c.finish()}
            for c in contenders
        }
        data["_ours_cpu_s"] = ours  # type: ignore[assignment]
        gathered: list[Any] = [None] * WORLD_SIZE
        dist.all_gather_object(gathered, data)
        if rank == 0:
            results.put(("ok", gathered))
        dist.destroy_process_group()
    except BaseException:
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))
        raise


def ratio_ci(base: list[float], tool: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """sum(tool)/sum(base) - 1, and its bootstrap 95% interval over rounds."""
    n = len(base)
    rng = random.Random(7)
    point = sum(tool) / sum(base) - 1
    boots = []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        boots.append(sum(tool[i] for i in idx) / sum(base[i] for i in idx) - 1)
    boots.sort()
    return point, boots[int(0.025 * draws)], boots[int(0.975 * draws) - 1]


def summarize(gathered: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per contender: the slower rank's wall time per block, and the ranks' mean CPU per block;
    rounds in which some block took more than ``--hiccup`` times its contender's median are left
    out of every contender alike (the VM's stalls of tens of ms), and counted by who had them."""
    names = [k for k in gathered[0] if not k.startswith("_")]
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        per_rank = [g[name] for g in gathered]
        rows[name] = {
            "wall": [max(vals) for vals in zip(*(r["wall"] for r in per_rank), strict=True)],
            "thread": [sum(vals) / len(vals) for vals in zip(*(r["thread"] for r in per_rank), strict=True)],
            "process": [sum(vals) / len(vals) for vals in zip(*(r["process"] for r in per_rank), strict=True)],
            "same_losses": all(r["losses"] == g[BASE]["losses"] for r, g in zip(per_rank, gathered, strict=True)),
            **{k: v for k, v in per_rank[0].items() if k not in ("wall", "thread", "process", "losses")},
        }
    n = len(rows[BASE]["wall"])
    dropped: dict[str, int] = {}
    keep = [True] * n
    if args.hiccup > 0:
        limits = {name: statistics.median(row["wall"]) * args.hiccup for name, row in rows.items()}
        for i in range(n):
            over = [name for name in names if rows[name]["wall"][i] > limits[name]]
            if over:
                keep[i] = False
                for name in over:
                    dropped[name] = dropped.get(name, 0) + 1
    for row in rows.values():
        for key in ("wall", "thread", "process"):
            row[key] = [v for v, k in zip(row[key], keep, strict=True) if k]
    kept = sum(keep)
    return {
        "contenders": rows,
        "rounds_kept": kept,
        "hiccups": dropped,
        "steps_per_contender": kept * args.block,
        "ours_cpu_us_per_step": sum(g["_ours_cpu_s"] for g in gathered) / len(gathered) * 1e6 / (n * args.block),
    }


def report(summary: dict[str, Any], args: argparse.Namespace) -> str:
    c = summary["contenders"]
    base = c[BASE]
    steps = summary["steps_per_contender"]
    lines = [
        "| contender | ms/step | overhead [95% interval] | training thread CPU, + µs/step "
        "| process CPU, + µs/step | same losses |",
        "|---|---:|---:|---:|---:|---|",
        f"| {BASE} | {sum(base['wall']) * 1e3 / steps:.3f} | — | ({sum(base['thread']) * 1e6 / steps:.0f} µs) "
        f"| ({sum(base['process']) * 1e6 / steps:.0f} µs) | — |",
    ]
    for name, row in c.items():
        if name == BASE:
            continue
        point, lo, hi = ratio_ci(base["wall"], row["wall"])
        dthread = (sum(row["thread"]) - sum(base["thread"])) * 1e6 / steps
        dproc = (sum(row["process"]) - sum(base["process"])) * 1e6 / steps
        label = f"{name} (noise)" if name == NOISE else name
        lines.append(
            f"| {label} | {sum(row['wall']) * 1e3 / steps:.3f} | **{pct(point)}** [{pct(lo)}, {pct(hi)}] "
            f"| {dthread:+.1f} | {dproc:+.1f} | {'yes' if row['same_losses'] else '**NO**'} |"
        )
    tool = c[TOOL]
    lines.append("")
    lines.append(
        f"ddpdoctor's own threads: {summary['ours_cpu_us_per_step']:.1f} µs of CPU per instrumented step and rank "
        f"(the log writer and the rest; they run beside whichever contender steps). ddpdoctor's own accounting "
        f"on the training thread (Monitor.own_ns): {tool.get('own_ns', 0) / 1e3 / steps:.1f} µs a step. "
        f"Route: {tool.get('timing')}; "
        f"steps recorded {tool.get('monitor_steps')}; probes off: {tool.get('probes_off') or 'none'}; "
        f"log {tool.get('log_bytes')} bytes."
    )
    hiccups = ", ".join(f"{k} {v}" for k, v in summary["hiccups"].items()) or "none"
    lines.append(
        f"Rounds kept: {summary['rounds_kept']} of {args.rounds}; left out, with a block over {args.hiccup}x its "
        f"contender's median (who had it): {hiccups}."
    )
    lines.append(
        f"{WORLD_SIZE} gloo ranks on CPU, torch {torch.__version__}, 1 thread/rank, {os.cpu_count()} cores; "
        f"model {args.model}; {args.rounds} rounds of {args.block} step(s) per contender; warm-up {args.warmup}; "
        f"built in the order {', '.join(args.built)}."
    )
    return "\n".join(lines)


def check(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What makes the figures void: a contender that trained differently, a monitor that did not
    record every step, switched a probe off or took another route than the one built."""
    problems = [
        f"{n}: losses differ from plain's" for n, row in summary["contenders"].items() if not row["same_losses"]
    ]
    tool = summary["contenders"][TOOL]
    total = args.warmup + args.rounds * args.block
    if tool.get("monitor_steps", 0) < total:
        problems.append(f"ddpdoctor recorded {tool.get('monitor_steps')} of {total} steps")
    if tool.get("probes_off"):
        problems.append(f"ddpdoctor switched probes off: {tool['probes_off']}")
    if args.expect_timing and tool.get("timing") != args.expect_timing:
        problems.append(f"ddpdoctor timed with the {tool.get('timing')} route, not {args.expect_timing}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SPECS), default="short")
    parser.add_argument(
        "--rounds", type=int, default=600, help="rounds: each contender steps --block steps (default 600)"
    )
    parser.add_argument("--block", type=int, default=1, help="steps per contender per round (default 1)")
    parser.add_argument("--warmup", type=int, default=60, help="warm-up steps per contender (default 60)")
    parser.add_argument("--attribution", action="store_true", help="add the attribution rows (see above)")
    parser.add_argument(
        "--hiccup", type=float, default=4.0, help="leave out rounds with a block over this x its median (0: keep all)"
    )
    parser.add_argument(
        "--build-order",
        default="given",
        help="the order the contenders' models are built in: given (plain, ddpdoctor, plain-2, ...), "
        "reverse, or names comma-separated (default given)",
    )
    parser.add_argument("--json", default=None, help="write the per-block figures here")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")
    args = parser.parse_args(argv)
    try:
        args.built = _build_order([BASE, TOOL, NOISE, *(ATTRIBUTION if args.attribution else ())], args.build_order)
    except ValueError as exc:
        parser.error(str(exc))
    from ddpdoctor.runtime.step import native_hook

    try:
        native_hook.load()  # built here once, before the ranks look for it
        args.expect_timing = "native"
    except native_hook.NativeUnavailable:
        args.expect_timing = "python"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ddpdoctor-interleaved-") as run_dir:
        shared = {
            "model": args.model,
            "rounds": args.rounds,
            "block": args.block,
            "warmup": args.warmup,
            "attribution": args.attribution,
            "built": args.built,
            "run_dir": run_dir,
        }
        procs = [ctx.Process(target=rank_main, args=(r, port, shared, results), daemon=True) for r in range(WORLD_SIZE)]
        start = time.monotonic()
        try:
            for p in procs:
                p.start()
            status, payload = results.get(timeout=args.timeout)
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
    if status != "ok":
        print(payload, file=sys.stderr)
        return 1
    summary = summarize(payload, args)
    print(report(summary, args))
    print(f"total {time.monotonic() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(summary))
    problems = check(summary, args)
    for p in problems:
        print(f"INVALID: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
