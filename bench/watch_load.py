"""Can ``ddpdoctor watch`` keep up? A synthetic writer feeds N rank files at R steps/s each while
the app runs headless; we measure screen lag and the app's memory over time.

The writer is a separate process (as training ranks are): for each step it appends one ``step``
record per rank (8 buckets, a few ms of random arrival skew, one rank late by 30 ms), a ``proc``
sample per rank every 10 steps, and reports when the step's last rank record was flushed. The app
(``WatchApp`` under Textual's headless ``run_test`` at 120x40, the real watcher thread and
``DirSource``) is timed at the moment it puts a step on the screen: lag = shown - written, for
the latest complete step, which is what the header, table and heatmap display. RSS is the app
process's (the writer excluded), sampled every second.

    python bench/watch_load.py [--ranks 256] [--rate 10] [--seconds 40] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from ddpdoctor.events import BucketInfo, Header, Layout, ProcSample, Step, encode
from ddpdoctor.events.layout import rank_file_name
from ddpdoctor.runlog import DirSource

BUCKETS = 8


def _step(rank: int, step: int, t0_ns: int, step_ms: float, late_ms: float, rng: random.Random) -> Step:
    skew = late_ms + rng.uniform(0.0, 2.0)
    ready = [20_000.0 + 8_000.0 * i + skew * 1000 for i in range(BUCKETS)]
    # a bucket's all-reduce completes for everyone once the latest rank (30 ms + 2 ms jitter) arrived
    done = [20_000.0 + 8_000.0 * i + 35_000.0 for i in range(BUCKETS)]
    return Step(
        rank=rank,
        step=step,
        t0_mono_ns=t0_ns,
        t0_wall_ns=t0_ns,
        fwd_start_us=0.0,
        fwd_us=15_000.0,
        fwd_end_us=15_000.0,
        bwd_end_us=ready[-1],
        b_ready_us=ready,
        b_launch_us=[t + 50 for t in ready],
        b_done_us=done,
        b_bytes=[4 << 20] * BUCKETS,
        sync_end_us=done[-1],
        opt_start_us=done[-1],
        opt_end_us=done[-1] + 2_000.0,
        end_us=step_ms * 1000,
    )


def writer(directory: str, ranks: int, rate: float, seconds: float, done_q: Any, straggler: int) -> None:
    """Append records for ``seconds`` at ``rate`` steps/s per rank; put (step, flushed_at) on ``done_q``."""
    rng = random.Random(0)
    files = [
        open(Path(directory) / rank_file_name(r), "ab", buffering=1 << 16)  # noqa: SIM115 - closed at the end
        for r in range(ranks)
    ]
    now_ns = time.time_ns()
    for r, f in enumerate(files):
        f.write(
            encode(
                Header(
                    rank=r,
                    run_id="watch-load",
                    world_size=ranks,
                    host=f"node{r // 8:03d}",
                    backend="nccl",
                    device="cuda",
                    t_mono_ns=now_ns,
                    t_wall_ns=now_ns,
                )
            )
        )
        f.write(
            encode(
                Layout(
                    rank=r,
                    step=0,
                    reason="initial",
                    buckets=[
                        BucketInfo(index=i, params=[f"layer{i}.weight"], bytes=4 << 20, dtype="float32")
                        for i in range(BUCKETS)
                    ],
                )
            )
        )
        f.flush()
    period = 1.0 / rate
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < seconds:
        t0_ns = time.time_ns()
        for r, f in enumerate(files):
            f.write(encode(_step(r, step, t0_ns, 1000.0 * period, 30.0 if r == straggler else 0.0, rng)))
            if step % 10 == 0:
                f.write(
                    encode(
                        ProcSample(
                            rank=r,
                            t_mono_ns=t0_ns,
                            t_wall_ns=t0_ns,
                            cpu_pct=rng.uniform(90, 100),
                            rss_bytes=(2 << 30) + rng.randrange(1 << 20),
                        )
                    )
                )
            f.flush()
        done_q.put((step, time.monotonic()))
        step += 1
        time.sleep(max(0.0, start + step * period - time.monotonic()))
    for f in files:
        f.close()


async def watch(directory: Path, seconds: float, done_q: Any) -> dict[str, Any]:
    from ddpdoctor_tui import WatchApp
    from ddpdoctor_tui.run_header import RunHeader

    shown: dict[int, float] = {}
    original = RunHeader.show

    def timed_show(self: RunHeader, snap: Any, paused: bool) -> None:
        original(self, snap, paused)
        if snap.view_step is not None and snap.view_step not in shown:
            shown[snap.view_step] = time.monotonic()

    RunHeader.show = timed_show  # type: ignore[method-assign]  # the bench times the real header's updates
    proc = psutil.Process()
    rss: list[tuple[float, int]] = []
    app = WatchApp(DirSource(directory))
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            start = time.monotonic()
            while time.monotonic() - start < seconds:
                await pilot.pause(1.0)
                rss.append((time.monotonic() - start, proc.memory_info().rss))
    finally:
        RunHeader.show = original  # type: ignore[method-assign]  # put back as it was
    written: dict[int, float] = {}
    while not done_q.empty():
        step, at = done_q.get()
        written[step] = at
    # a step the app skipped (it jumped to a newer one) was shown with that newer one
    lags = []
    shown_steps = sorted(shown)
    for step, at in written.items():
        later = [shown[s] for s in shown_steps if s >= step]
        if later:
            lags.append(min(later) - at)
    snap = app.snapshot
    named = sorted({r for f in snap.findings if f.code == "straggler" for r in f.ranks}) if snap else []
    return {"lags": lags, "rss": rss, "written": len(written), "shown": len(shown), "stragglers": named}


def one_run(ranks: int, rate: float, seconds: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="watch-load-") as tmp:
        done_q = ctx.Queue()
        w = ctx.Process(target=writer, args=(tmp, ranks, rate, seconds, done_q, ranks // 3), daemon=True)
        w.start()
        try:
            result = asyncio.run(watch(Path(tmp), seconds + 2.0, done_q))
        finally:
            w.join(10)
            if w.is_alive():
                w.kill()
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--rate", type=float, default=10.0, help="steps per second per rank")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one run, JSON out (internal)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.ranks, args.rate, args.seconds)))
        return
    medians, p95s, maxes, growth, final = [], [], [], [], []
    for i in range(args.runs):
        # each run in a fresh process: its RSS is that run's alone
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                "--ranks",
                str(args.ranks),
                "--rate",
                str(args.rate),
                "--seconds",
                str(args.seconds),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=args.seconds + 120,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        lags = sorted(r["lags"])
        if not lags:
            print(f"run {i + 1}: nothing shown")
            continue
        med, p95 = statistics.median(lags), lags[int(0.95 * (len(lags) - 1))]
        rss = r["rss"]
        warm = next((m for t, m in rss if t >= 10.0), rss[0][1])
        medians.append(med)
        p95s.append(p95)
        maxes.append(lags[-1])
        growth.append((rss[-1][1] - warm) / 2**20)
        final.append(rss[-1][1] / 2**20)
        print(
            f"run {i + 1}: {r['written']} steps written, {r['shown']} shown; lag median {med * 1000:.0f} ms, "
            f"p95 {p95 * 1000:.0f} ms, max {lags[-1] * 1000:.0f} ms; RSS at 10 s {warm / 2**20:.0f} MiB, "
            f"at the end {rss[-1][1] / 2**20:.0f} MiB; straggler named: {r['stragglers']}",
            flush=True,
        )
        series = [f"{t:.0f}s {m / 2**20:.0f}" for t, m in rss[9::10]]
        print(f"       RSS MiB over time: {', '.join(series)}", flush=True)
    if medians:
        print(
            f"\n{args.ranks} ranks x {args.rate:g} steps/s, {args.seconds:g} s, median of {len(medians)} runs: "
            f"lag median {statistics.median(medians) * 1000:.0f} ms, p95 {statistics.median(p95s) * 1000:.0f} ms, "
            f"max {statistics.median(maxes) * 1000:.0f} ms; RSS {statistics.median(final):.0f} MiB at the end, "
            f"{statistics.median(growth):+.0f} MiB after the first 10 s"
        )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
