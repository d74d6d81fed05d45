"""Write a realistic synthetic run through ddpdoctor's own writer, then time ``ddpdoctor report`` on it.

usage: python bench/synth_run.py --ranks 256 --steps 10000 [--straggler 17] [--slow-node 5]
                                 [--dead-rank 200] [--buckets 8] [--log-mode compact|full]
                                 [--only A:B] [--report] [--text] [--repeat 3] OUT

Each rank file is written by a ``FileSink`` (the writer every training rank uses, with the same
compaction: ``--log-mode``, default compact), from the records ``bench/synth.py`` generates:
per-step records with per-bucket arrays, process samples, fingerprints and unused-parameter
checks at the sampled steps, an end record. ``--only A:B`` writes ranks A..B-1 alone (a big run
written in parts; then ``--reuse --report``). It prints the bytes per rank-step. With ``--report``
the script then runs ``python -m ddpdoctor report OUT --format json`` ``--repeat`` times in a
fresh process each and prints the wall time and the peak RSS of that process (median of the
runs), and whether the planted straggler was named. ``--slow-node N`` plants a slow host (its 8
ranks' forward 15 ms slower), ``--dead-rank R`` a rank that stops after three quarters of the
steps without an end record. ``--text`` times the text report instead of the JSON one and prints
its length in lines.

Measured (2 cores shared with other jobs, load average 9-12): 2,048 ranks x 40 steps with a
straggler, a slow node and a dead rank (``--ranks 2048 --steps 40 --straggler 1234 --slow-node 100
--dead-rank 1900``): ``ddpdoctor report`` (text) 5.3-5.5 s of CPU (11-16 s wall under that
load), 221 MiB peak RSS, 28 lines; the tree before the report led with the ranks out of line took
the same CPU time (5.4-5.5 s) and printed 2,066 lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.synth import Planted, rank_records
from ddpdoctor.events.layout import rank_file_name
from ddpdoctor.sinks import FileSink


def write_rank(
    out: str,
    rank: int,
    world: int,
    steps: int,
    buckets: int,
    straggler: int | None,
    mode: str = "compact",
    slow_node: int | None = None,
    dead: int | None = None,
) -> int:
    """Write one rank's file through a ``FileSink``; the number of records written."""
    sink = FileSink(Path(out) / rank_file_name(rank), mode=mode)
    n = 0
    planted = Planted(straggler=straggler, slow_node=slow_node)
    for record in rank_records(rank, world, steps, buckets=buckets, planted=planted, dead=dead):
        sink.emit(record)
        n += 1
    sink.close(timeout=120.0)
    if sink.dropped:
        raise RuntimeError(f"rank {rank}: the writer dropped {sink.dropped} records")
    return n


def write_run(
    out: Path,
    ranks: int,
    steps: int,
    buckets: int,
    straggler: int | None,
    jobs: int,
    mode: str = "compact",
    only: range | None = None,
    slow_node: int | None = None,
    dead: int | None = None,
) -> tuple[int, float]:
    """Write every rank's file (or ``only`` those) in ``jobs`` processes: (records, seconds)."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    which = only if only is not None else range(ranks)
    n = len(which)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        counts = list(
            pool.map(
                write_rank,
                [str(out)] * n,
                which,
                [ranks] * n,
                [steps] * n,
                [buckets] * n,
                [straggler] * n,
                [mode] * n,
                [slow_node] * n,
                [dead] * n,
            )
        )
    return sum(counts), time.monotonic() - started


def time_report(out: Path, fmt: str = "json") -> tuple[float, float, str]:
    """One ``ddpdoctor report`` in a fresh process: (seconds, peak RSS in MiB, its output)."""
    script = (
        "import resource, subprocess, sys, time; t = time.monotonic(); "
        "p = subprocess.run([sys.executable, '-m', 'ddpdoctor', 'report', sys.argv[1], '--format', sys.argv[2]], "
        "capture_output=True, text=True); dt = time.monotonic() - t; "
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024; "
        "sys.stderr.write(p.stderr); print(dt, rss); print(p.stdout)"
    )
    done = subprocess.run([sys.executable, "-c", script, str(out), fmt], capture_output=True, text=True, check=True)
    first, _, rest = done.stdout.partition("\n")
    seconds, rss = (float(v) for v in first.split())
    return seconds, rss, rest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--buckets", type=int, default=8)
    ap.add_argument("--straggler", type=int, default=None, help="a rank whose backward is 30 ms slower")
    ap.add_argument("--slow-node", type=int, default=None, help="a host whose ranks' forward is 15 ms slower")
    ap.add_argument("--dead-rank", type=int, default=None, help="a rank that stops with no end record")
    ap.add_argument("--text", action="store_true", help="with --report: time the text report")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--report", action="store_true", help="then time `ddpdoctor report` on it")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reuse", action="store_true", help="do not write: the run is already there")
    ap.add_argument("--log-mode", choices=["compact", "full"], default="compact", help="what the writer keeps")
    ap.add_argument("--only", default=None, help="A:B: write ranks A..B-1 only")
    args = ap.parse_args()
    if not args.reuse:
        only = None
        if args.only:
            a, _, b = args.only.partition(":")
            only = range(int(a), int(b))
        n, dt = write_run(
            args.out,
            args.ranks,
            args.steps,
            args.buckets,
            args.straggler,
            args.jobs,
            args.log_mode,
            only,
            args.slow_node,
            args.dead_rank,
        )
        written = len(only) if only is not None else args.ranks
        size = sum(f.stat().st_size for f in args.out.iterdir() if only is None or int(f.name[5:10]) in only)
        print(
            f"wrote {n:,} records, {size / 2**20:,.0f} MiB, {written} ranks x {args.steps:,} steps in {dt:.1f} s: "
            f"{size / (written * args.steps):.1f} bytes per rank-step ({args.log_mode} log)"
        )
    if args.report:
        runs = [time_report(args.out, "text" if args.text else "json") for _ in range(args.repeat)]
        secs = [r[0] for r in runs]
        rss = [r[1] for r in runs]
        if args.text:
            print(runs[-1][2], end="")
            print(
                f"ddpdoctor report (text, {len(runs[-1][2].splitlines())} lines): median "
                f"{statistics.median(secs):.1f} s (runs: {', '.join(f'{s:.1f}' for s in secs)}), "
                f"peak RSS median {statistics.median(rss):,.0f} MiB"
            )
            return 0
        report = json.loads(runs[-1][2])
        stragglers = [f["ranks"] for f in report["findings"] if f["code"] == "straggler"]
        print(
            f"ddpdoctor report: median {statistics.median(secs):.1f} s (runs: {', '.join(f'{s:.1f}' for s in secs)}), "
            f"peak RSS median {statistics.median(rss):,.0f} MiB (max {max(rss):,.0f})"
        )
        print(
            f"straggler findings: {stragglers or 'none'}; findings: "
            f"{[(f['code'], f['severity']) for f in report['findings']]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
