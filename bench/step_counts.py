"""Counts that do not depend on the machine's speed: what ddpdoctor adds to the short model's
training thread, per step, in Python lines, context switches and (under valgrind) instructions.

Two gloo ranks train the short model of ``bench/overhead.py``, plain or with ``ddpdoctor.instrument``
(the file sink into a temporary run dir), after 100 warm-up steps.

* ``lines``: ``sys.settrace`` on rank 0's training thread over ``--steps`` steps, the lines run and
  the calls made per step in each function of ddpdoctor's, and of torch's module and optimizer
  code (where hooks take torch's slower paths). Tracing slows the steps, so what ddpdoctor does on
  a timer (its batched emission, every 32 steps or 0.2 s) comes out more often than untraced.
* ``switches``: the training thread's voluntary and involuntary context switches, minor page
  faults, and its user and system CPU per step, read from ``/proc/self/task/<tid>``.
* ``rank``: one rank, for a run under valgrind (each rank its own process)::

      port=$(python -c "from bench.harness import free_port; print(free_port())")
      for r in 0 1; do valgrind --tool=callgrind --separate-threads=yes \\
          --callgrind-out-file=cg.MODE.STEPS.r$r python3 bench/step_counts.py rank $r $port MODE STEPS & done; wait

  then the same with another STEPS: the difference of the two runs' totals for the training
  thread (the ``-01`` file) over the difference of their steps is its instructions per step
  (``callgrind_annotate`` prints the totals). ``PYTHONHASHSEED`` varies dict probes from run to
  run (±15 k instructions a step here).

Usage: ``python bench/step_counts.py lines|switches [--steps N] [--plain]`` or
``python bench/step_counts.py rank RANK PORT plain|ddpdoctor STEPS``.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
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


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank, port, mode, steps = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        step = _trainer(rank, port, mode != "plain")
        for i in range(steps):
            step(WARMUP + i)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("lines", "switches"))
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--plain", action="store_true", help="without ddpdoctor (the baseline)")
    args = parser.parse_args()
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
