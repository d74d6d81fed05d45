"""What building one step's record costs: the extension's ``build_step`` against Python's.

A closed step (``OpenStep``: host-clock marks, four buckets, an optimizer step) becomes a
``Step`` record when the batched emission takes it (``StepRecorder.emit_closed``). Here the
same closed steps are built again and again in a loop, so the figure is the warm cost of the
code itself: ``--steps`` distinct steps (16: the size of a typical batch, all in cache; 20,000:
the steps' data out of cache), ``--rounds`` rounds of about 20,000 builds each, median, in µs per
record. The records of both routes are checked equal first. ``--window N`` keeps each record
until N more were built, as the live checks' window does (100), so it is freed out of cache and
the figure holds its free as well as its build.

    python bench/step_record.py [--steps 16] [--rounds 5] [--window 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddpdoctor.events import Step
from ddpdoctor.runtime import native_hook
from ddpdoctor.runtime.clocks import HostClock
from ddpdoctor.runtime.step_recorder import OpenStep, StepRecorder


def _closed(index: int) -> OpenStep:
    now = time.perf_counter_ns()
    step = OpenStep(index, now)
    step.fwd_start, step.fwd_end, step.bwd_end = now, now + 1_000, now + 5_000
    step.ready = [now + 2_000 + 10 * k for k in range(4)]
    step.launch = list(step.ready)
    step.done = [now + 3_000 + 10 * k for k in range(4)]
    step.nbytes = [16_640, 16_640, 16_640, 1_040]
    step.opt_start, step.opt_end, step.end = now + 6_000, now + 7_000, now + 8_000
    step.synced_forward = True
    return step


def _per_record(build: Callable[[OpenStep], Any], steps: list[OpenStep], rounds: int, window: int) -> float:
    reps = max(1, 20_000 // len(steps))
    times = []
    kept: deque[Any] = deque(maxlen=max(1, window))
    keep = kept.append
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(reps):
            for step in steps:
                keep(build(step))
        times.append((time.perf_counter_ns() - start) / (reps * len(steps)) / 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="distinct closed steps built in turn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=1, help="records kept, freed that many builds later")
    args = parser.parse_args()
    extension = native_hook.load()
    recorder = StepRecorder(0, 0, lambda record: None, HostClock())
    steps = [_closed(i) for i in range(args.steps)]
    clock = recorder.clock.name

    def native(step: OpenStep) -> Step:
        return extension.build_step(step, Step, 0, 0, clock)

    def python(step: OpenStep) -> Step:
        return recorder._record(step, True)

    assert all(native(s) == python(s) for s in steps), "the two routes built different records"
    print(f"{args.steps} closed steps, median of {args.rounds} rounds, window {args.window}, µs per record")
    for label, build in (("extension (build_step)", native), ("Python (_record)", python)):
        print(f"  {label:24s} {_per_record(build, steps, args.rounds, args.window):6.2f}")


if __name__ == "__main__":
    main()
