"""Counts that do not depend on the machine's speed: what ddpdoctor adds to the short model's
training thread, per step, in Python lines, context switches and (under valgrind) instructions.

Two gloo ranks train the short model of ``bench/overhead.py``, plain or with ``ddpdoctor.instrument``
(the file sink into a temporary run dir), after 100 warm-up steps.

* ``lines``: ``sys.settrace`` on rank 0's training thread over ``--steps`` steps, the lines run and
  the calls made per step in each function of ddpdoctor's, and of torch's module and optimizer
  code (where hooks take torch's slower paths). Tracing slows the steps, so what ddpdoctor does on
  a timer (its batched emission, every 32 steps or 50 ms) comes out more often than untraced.
* ``switches``: the training thread's voluntary and involuntary context switches, minor page
  faults, and its user and system CPU per step, read from ``/proc/self/task/<tid>``.
* ``cache``: the whole valgrind measurement below, run and read in one go (about 17 minutes on
  2 cores): both modes, both ranks, at ``--steps`` and ``--steps`` + 200, under callgrind with
  its cache simulation (``--cache-sim=yes``: a 32 KiB instruction and a 48 KiB data L1, and a last
  level, as this CPU reports them; no prefetcher, so a loop streaming over a buffer bigger than
  the L1 misses on every line, which the hardware would mostly hide). It prints the training
  thread's instructions, L1 instruction misses and L1 data misses a step, plain and with
  ddpdoctor, and the functions whose counts moved the most. Deterministic up to the hash seed
  (fixed here), so it compares trees where the timing benches cannot.
* ``rank``: one rank, for a run under valgrind (each rank its own process)::

      port=$(python -c "from bench.harness import free_port; print(free_port())")
      for r in 0 1; do valgrind --tool=callgrind --separate-threads=yes \\
          --callgrind-out-file=cg.MODE.STEPS.r$r python3 bench/step_counts.py rank $r $port MODE STEPS & done; wait

  then the same with another STEPS: the difference of the two runs' totals for the training
  thread (the ``-01`` file) over the difference of their steps is its instructions per step
  (``callgrind_annotate`` prints the totals). ``PYTHONHASHSEED`` varies dict probes from run to
  run (±15 k instructions a step here).

Usage: ``python bench/step_counts.py lines|switches [--steps N] [--plain]``,
``python bench/step_counts.py cache [--steps 40] [--out DIR]`` or
``python bench/step_counts.py rank RANK PORT plain|ddpdoctor STEPS``.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import free_port, init_gloo
from bench.overhead import SPECS, build_training

WARMUP = 100
ROOT = str(Path(__file__).resolve().parent.parent / "ddpdoctor")
TORCH_FILES = ("torch/nn/modules/module.py", "torch/optim/")


def _trainer(rank: int, port: int, instrumented: bool) -> Any:
    """A step function of the short model in a 2-rank gloo group (ddpdoctor on it if asked)."""
    init_gloo(rank, 2, port)
    ddp, opt, loss_fn, batches = build_training(SPECS["short"], rank)
    if instrumented:
        import ddpdoctor

        ddpdoctor.instrument(ddp, run_dir=tempfile.mkdtemp(prefix="ddpdoctor-counts-"))

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        loss = loss_fn(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for i in range(WARMUP):
        step(i)
    return step


def _lines(step: Any, steps: int) -> str:
    lines: collections.Counter[tuple[str, str]] = collections.Counter()
    calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def local(frame: Any, event: str, _arg: Any) -> Any:
        if event == "line":
            lines[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
        return local

    def calls_of(frame: Any, _event: str, _arg: Any) -> Any:
        name = frame.f_code.co_filename
        if name.startswith(ROOT) or any(f in name for f in TORCH_FILES):
            calls[(name, frame.f_code.co_name)] += 1
            return local
        return None

    sys.settrace(calls_of)
    try:
        for i in range(steps):
            step(WARMUP + i)
    finally:
        sys.settrace(None)
    ours = sum(v for (f, _), v in lines.items() if f.startswith(ROOT)) / steps
    torch_lines = sum(v for (f, _), v in lines.items() if not f.startswith(ROOT)) / steps
    out = [f"ddpdoctor's lines a step {ours:.1f}; torch's module and optimizer code {torch_lines:.1f}"]
    for (f, fn), v in lines.most_common(30):
        where = "ddpdoctor" + f[len(ROOT) :] if f.startswith(ROOT) else f.split("site-packages/")[-1]
        out.append(f"{v / steps:8.1f} lines {calls[(f, fn)] / steps:6.2f} calls  {where}:{fn}")
    return "\n".join(out)


def _switches(step: Any, steps: int) -> str:
    def read() -> dict[str, int]:
        task = f"/proc/self/task/{threading.get_native_id()}"
        values = {}
        for line in Path(task, "status").read_text().splitlines():
            if "ctxt_switches" in line:
                key, value = line.split(":")
                values[key] = int(value)
        fields = Path(task, "stat").read_text().rsplit(")", 1)[1].split()
        values["minflt"] = int(fields[7])  # minor page faults (the allocator's pages, first touched)
        values["utime_us"], values["stime_us"] = int(fields[11]), int(fields[12])  # clock ticks, scaled below
        return values

    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    before = read()
    for i in range(steps):
        step(WARMUP + i)
    after = read()
    per = {k: (after[k] - before[k]) / steps * (tick_us if k.endswith("_us") else 1) for k in before}
    return "  ".join(f"{k} {v:.2f}" for k, v in per.items())


def _worker(rank: int, port: int, what: str, steps: int, instrumented: bool, results: Any) -> None:
    step = _trainer(rank, port, instrumented)
    if what == "lines" and rank != 0:  # (the other rank trains along, untraced)
        for i in range(steps):
            step(WARMUP + i)
        results.put((rank, ""))
        return
    results.put((rank, _lines(step, steps) if what == "lines" else _switches(step, steps)))


# -- cache: callgrind's counts of the training thread ------------------------------------------

#: the events a step is counted in (callgrind's names), and how they are printed
EVENTS = {"Ir": "instructions", "I1mr": "L1 instruction misses", "D1mr": "L1 data read misses"}
_VALUE = r"([\d,]+|\.)(?: \([^)]*\))?\s+"
_ROW = re.compile(r"\s*" + _VALUE * len(EVENTS) + r"(\S.*)$")


def _callgrind(out: Path, mode: str, steps: int) -> list[Path]:
    """Both ranks of one mode under callgrind (side by side: one gloo group); the training
    thread's profile of each (``-01``: valgrind's first thread is the main one)."""
    port = free_port()
    python = os.path.realpath(sys.executable)  # (not a shim: valgrind would trace the shim)
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    procs = []
    try:
        for rank in (0, 1):
            cmd = [
                "valgrind", "--tool=callgrind", "--cache-sim=yes", "--separate-threads=yes",
                f"--callgrind-out-file={out}/cg.{mode}.{steps}.r{rank}",
                python, __file__, "rank", str(rank), str(port), mode, str(steps),
            ]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p in procs:
            if p.wait(timeout=1800) != 0:
                raise RuntimeError(f"a {mode} rank under valgrind exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    return [out / f"cg.{mode}.{steps}.r{rank}-01" for rank in (0, 1)]


def _functions(path: Path) -> dict[str, list[int]]:
    """Each function's own counts (``EVENTS``) in one profile, by name."""
    text = subprocess.run(
        ["callgrind_annotate", "--threshold=100", f"--show={','.join(EVENTS)}", str(path)],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout  # fmt: skip
    by: dict[str, list[int]] = collections.defaultdict(lambda: [0] * len(EVENTS))
    for line in text.splitlines():
        m = _ROW.match(line)
        if not m or "PROGRAM TOTALS" in line:
            continue
        name = re.sub(r" \[.*\]$", "", m.group(len(EVENTS) + 1))
        name = re.sub(r"'\d+$", "", name.rsplit("/", 1)[-1])  # (a recursion level is the same function)
        for i in range(len(EVENTS)):
            value = m.group(i + 1)
            by[name][i] += 0 if value == "." else int(value.replace(",", ""))
    return by


def _per_step(short: Path, long: Path, steps: int) -> dict[str, list[float]]:
    a, b = _functions(short), _functions(long)
    zero = [0] * len(EVENTS)
    return {
        k: [(y - x) / steps for x, y in zip(a.get(k, zero), b.get(k, zero), strict=True)] for k in a.keys() | b.keys()
    }


def _cache(steps: int, out: Path) -> str:
    longer = steps + 200
    runs = {(mode, n): _callgrind(out, mode, n) for mode in ("plain", "ddpdoctor") for n in (steps, longer)}
    lines = []
    for rank in (0, 1):
        plain = _per_step(runs["plain", steps][rank], runs["plain", longer][rank], 200)
        ours = _per_step(runs["ddpdoctor", steps][rank], runs["ddpdoctor", longer][rank], 200)
        zero = [0.0] * len(EVENTS)
        delta = {
            k: [o - p for o, p in zip(ours.get(k, zero), plain.get(k, zero), strict=True)]
            for k in plain.keys() | ours.keys()
        }
        lines.append(f"rank {rank}, the training thread a step (plain -> ddpdoctor):")
        for i, (event, what) in enumerate(EVENTS.items()):
            p, o = sum(v[i] for v in plain.values()), sum(v[i] for v in ours.values())
            lines.append(f"  {what:22} ({event:4}) {p:12,.0f} -> {o:12,.0f}  {o - p:+10,.0f}")
        if rank == 0:
            lines.append("  the functions whose counts moved the most (ddpdoctor - plain, a step):")
            lines.append(f"  {'Ir':>9} {'I1mr':>7} {'D1mr':>7}  function")
            # misses first (each costs what tens of instructions do), instructions weighed 1/50
            top = sorted(delta.items(), key=lambda kv: -sum(abs(v) for v in kv[1][1:]) - abs(kv[1][0]) / 50)[:25]
            for name, (ir, i1, d1) in top:
                lines.append(f"  {ir:+9,.0f} {i1:+7,.0f} {d1:+7,.0f}  {name[:110]}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank, port, mode, steps = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        step = _trainer(rank, port, mode != "plain")
        for i in range(steps):
            step(WARMUP + i)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("lines", "switches", "cache"))
    parser.add_argument("--steps", type=int, default=None, help="lines, switches: 1600; cache: 40 (and 240)")
    parser.add_argument("--plain", action="store_true", help="without ddpdoctor (the baseline)")
    parser.add_argument(
        "--out", type=Path, default=None, help="cache: where the profiles go (default: a temporary dir)"
    )
    args = parser.parse_args()
    if args.what == "cache":
        if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
            sys.exit("step_counts.py cache needs valgrind (apt-get install valgrind)")
        out = args.out or Path(tempfile.mkdtemp(prefix="ddpdoctor-callgrind-"))
        out.mkdir(parents=True, exist_ok=True)
        print(_cache(args.steps or 40, out))
        print(f"(profiles in {out})")
        return
    args.steps = args.steps or 1600
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, port, args.what, args.steps, not args.plain, results)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        for rank, text in sorted(results.get(timeout=900) for _ in procs):
            if text:
                print(f"rank {rank} ({'plain' if args.plain else 'ddpdoctor'}): {text}")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    main()
