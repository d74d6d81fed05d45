"""How ``ddpdoctor report`` grows with the steps and with the ranks of a run.

usage: python bench/report_scale.py --ranks 64 --steps 10000,160000 [--templates 8] [--no-index]
                                    [--repeat 1] [--keep] WORK

For each step count it writes a synthetic run of ``--ranks`` ranks in WORK: ``--templates``
distinct ranks through ``FileSink`` (the writer every training rank uses, compact log, from
``bench/synth.py``), then every other rank as a copy of one of them with its rank number
rewritten line by line and its line index written anew, as the writer writes it (generating
every rank from scratch would take an hour at 1,024 ranks x 100,000 steps on 2 cores).
``--no-index`` leaves the index out: a log of an older ddpdoctor, which the reader scans. Then
it runs ``python -m ddpdoctor report RUN --format json`` in a fresh process ``--repeat`` times
and prints the wall time, the CPU time (user + system) and the peak RSS of that process.

Measured on a 2-core machine shared with other work (load average 6 to 12 while measuring: wall
times vary with it, the CPU time less; best of ``--repeat``):

    python bench/report_scale.py --ranks 64 --steps 10000,160000 --repeat 2 /tmp/rs64
      64 x 10,000:  wall 8.3 s, CPU 5.9 s, peak RSS 223 MiB (77 MiB of logs)
      64 x 160,000: wall 10.3 s, CPU 8.4 s, peak RSS 201 MiB (1,226 MiB of logs)
      160,000 vs 10,000 steps: wall x1.25, CPU x1.42 (load average 6 to 7)
      before the line index (the same logs scanned whole): 64 x 160,000 took CPU 15.1 s, x2.8
    python bench/report_scale.py --ranks 1024 --steps 100000 /tmp/rs1024
      1,024 x 100,000 (12,272 MiB of logs): wall 76.6 s, CPU 51.5 s, peak RSS 1,082 MiB
      (load average 5); before the window cap of the sampled read: wall 297 s at load average
      10.6, CPU 80 s, peak RSS 1,236 MiB

Every copy is removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.synth_run import write_rank
from ddpdoctor.events.layout import rank_file_name
from ddpdoctor.events.line_index import INDEX_PREFIX, LineIndexer

_HEAD = re.compile(rb'\{"kind":"(step|window)","rank":-?\d+(?:,"ddp":\d+)?,"step":(\d+)(?:,"n":(\d+))?')
_RANK = re.compile(rb'"rank":\d+')


def clone_rank(template: str, out: str, rank: int, index: bool) -> int:
    """Rank ``rank``'s file as a copy of ``template`` with its rank rewritten (and indexed anew)."""
    path = Path(out)
    data = Path(template).read_bytes()
    new = f'"rank":{rank}'.encode()
    with open(path, "wb") as f:
        indexer = LineIndexer(path, 0) if index else None
        buf = bytearray()
        for line in data.split(b"\n"):
            if not line or line.startswith(INDEX_PREFIX):
                continue
            mark = len(buf)
            buf += _RANK.sub(new, line, count=1)
            buf += b"\n"
            if indexer is not None:
                m = _HEAD.match(buf, mark)
                head = None
                if m is not None:
                    head = ("s" if m.group(1) == b"step" else "w", int(m.group(2)), int(m.group(3) or 0))
                indexer.note(buf, mark, head)
            if len(buf) >= 1 << 20:
                _write(f, indexer, buf, final=False)
        _write(f, indexer, buf, final=True)
    return path.stat().st_size


def _write(f: object, indexer: LineIndexer | None, buf: bytearray, final: bool) -> None:
    before, after = indexer.wrap(len(buf), final) if indexer is not None else (b"", b"")
    f.write(before + bytes(buf) + after)  # type: ignore[attr-defined]
    buf.clear()


def write_scaled(run: Path, ranks: int, steps: int, templates: int, index: bool, jobs: int) -> float:
    """Write the run; the seconds it took."""
    started = time.monotonic()
    run.mkdir(parents=True, exist_ok=True)
    tdir = run.parent / f"{run.name}.templates"
    tdir.mkdir(exist_ok=True)
    k = min(templates, ranks)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(write_rank, [str(tdir)] * k, range(k), [ranks] * k, [steps] * k, [8] * k, [None] * k))
        list(
            pool.map(
                clone_rank,
                [str(tdir / rank_file_name(r % k)) for r in range(ranks)],
                [str(run / rank_file_name(r)) for r in range(ranks)],
                range(ranks),
                [index] * ranks,
                chunksize=8,
            )
        )
    shutil.rmtree(tdir)
    return time.monotonic() - started


def time_report(run: Path) -> tuple[float, float, float]:
    """One ``ddpdoctor report`` in a fresh process: (wall s, CPU s, peak RSS MiB)."""
    script = (
        "import resource, subprocess, sys, time; t = time.monotonic(); "
        "p = subprocess.run([sys.executable, '-m', 'ddpdoctor', 'report', sys.argv[1], '--format', 'json'], "
        "capture_output=True, text=True); dt = time.monotonic() - t; "
        "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
        "sys.stderr.write(p.stderr[-2000:]); print(dt, u.ru_utime + u.ru_stime, u.ru_maxrss / 1024, p.returncode)"
    )
    done = subprocess.run([sys.executable, "-c", script, str(run)], capture_output=True, text=True, check=True)
    wall, cpu, rss, code = done.stdout.split()
    if code != "0":
        raise RuntimeError(f"report failed: {done.stderr}")
    return float(wall), float(cpu), float(rss)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--steps", default="10000,160000", help="comma-separated step counts")
    ap.add_argument("--templates", type=int, default=8)
    ap.add_argument("--no-index", action="store_true", help="write no line index (an older ddpdoctor's logs)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    results = []
    for steps in (int(s) for s in args.steps.split(",")):
        run = args.work / f"r{args.ranks}-s{steps}{'-noindex' if args.no_index else ''}"
        if not run.exists():
            took = write_scaled(run, args.ranks, steps, args.templates, not args.no_index, args.jobs)
            size = sum(p.stat().st_size for p in run.iterdir())
            print(f"wrote {args.ranks} ranks x {steps:,} steps ({size / 2**20:,.0f} MiB) in {took:.0f} s", flush=True)
        runs = [time_report(run) for _ in range(args.repeat)]
        wall, cpu, rss = (min(r[i] for r in runs) for i in range(3))
        load = os.getloadavg()[0]
        results.append({"ranks": args.ranks, "steps": steps, "wall_s": wall, "cpu_s": cpu, "rss_mib": rss})
        print(
            f"report {args.ranks} ranks x {steps:,} steps: wall {wall:.1f} s, CPU {cpu:.1f} s, "
            f"peak RSS {rss:,.0f} MiB (best of {args.repeat}; load average {load:.1f})",
            flush=True,
        )
        if not args.keep:
            shutil.rmtree(run)
    if len(results) > 1:
        first, last = results[0], results[-1]
        print(
            f"{last['steps']:,} vs {first['steps']:,} steps: wall x{last['wall_s'] / first['wall_s']:.2f}, "
            f"CPU x{last['cpu_s'] / first['cpu_s']:.2f}"
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
