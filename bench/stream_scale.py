"""Can one ``ddpdoctor watch --listen`` (or ``collect``) take a 2,048-rank job's live stream?

usage: python bench/stream_scale.py [--ranks 256,1024,2048] [--seconds 30] [--rate 1]
                                    [--mode direct|relay] [--per-node 8] [--senders 4]
                                    [--baseline DIR [--pairs N]] [--analysis STEPS]

Simulated ranks on loopback speak the documented wire protocol (``events.wire``): ``--senders``
processes each hold a share of the ranks, and at ``--rate`` steps per second send every rank's
hello, header, then one full step record (8 buckets, ``bench/synth.py``) per step, and a stats
line now and then. ``direct``: one TCP connection per rank, as ``ddpdoctor run --endpoint`` makes
them. ``relay``: one connection per node of ``--per-node`` ranks, as the relay of ``ddpdoctor run
--metrics --endpoint`` sends them (a hello before each rank's lines).

The receiver is a process of its own running what ``watch --listen`` runs, without drawing: the
``StreamSource`` and the TUI's own ``Watcher`` thread (poll, live analysis, a snapshot every
0.2 s), whose snapshots are timed. Lag of step k: from when the senders were due to send it to
the first snapshot whose view (the latest step every rank completed) reached it. Reported: lag
p50/p95/max over the steps after the first 3 s, the records received against those sent (loss),
what the receiver counted as refused or lost, its CPU (user + system over the run, as % of one
core; the listener's and the watcher's threads apart, the CPU of each snapshot, of all feeds) and
its peak RSS. ``--baseline DIR``: each size runs on DIR's ddpdoctor (another checkout) and on this
one's in turn, ``--pairs`` times, so that both see the same load. ``--analysis STEPS``: the live
analysis alone, no sockets: a ``LiveRun`` fed STEPS steps of synthetic records in the watcher's
five batches a step, a snapshot after each; the CPU per step, per feed and per snapshot, which the
machine's load hardly moves.

Every loop is bounded by ``--seconds`` (plus 20 s to drain); the senders and the receiver are
killed at the end whatever happened.

Measured 2026-12-06 on a 2-core machine shared with other work, ``--baseline`` the commit before
the live analysis scaled (rows rebuilt only where they changed, bucket views on first use, the
collectives compared only once a step differs, the lost check gated, blame's noise median read by
index). ``--ranks 2048 --analysis 70`` (load average 14 to 17), CPU ms:

    code      per step  (steps 35-69)  feed p50  feed p95  snapshot p50  snapshot p95
    before    1,846     2,395          192       630       92.5          252
    after     145       145            2.8       80        5.5           31.8

``--ranks 2048 --seconds 30 --pairs 2``, senders and receiver on the same 2 cores, run with
``nice -n 5`` under a load average of 11 to 13:

    code      lag p50  p95     max     receiver CPU  watcher CPU  snapshots  snapshot CPU p50/p95
    before    2.8 s    4.8 s   5.0 s   39.8 %        11.3 s       33         97 / 280 ms
    after     0.79 s   1.77 s  3.5 s   24.4 %        6.0 s        59         28 / 42 ms
    after     0.84 s   1.66 s  2.7 s   23.9 %        5.7 s        64         23 / 41 ms
    before    2.8 s    6.4 s   7.6 s   37.3 %        10.2 s       34         94 / 308 ms

After the change, on the quiet machine (load average under 0.3; senders and receiver still on
its 2 cores), ``--ranks 256,1024,2048 --seconds 30``, then 2,048 twice more:

    ranks  mode    lag p50      p95          max          received/sent   receiver CPU  peak RSS
    256    direct  0.11 s       0.19 s       0.21 s       8,192/8,192     1.7 %         67 MiB
    1,024  direct  0.17 s       0.27 s       0.35 s       32,768/32,768   7.5 %         152 MiB
    2,048  direct  0.26-0.29 s  0.56-0.58 s  0.59-1.48 s  65,536/65,536   16.5-17.8 %   265 MiB

Before the change, on the same machine (load average 8 to 14 while measuring), ``--seconds 30``:

    ranks  mode    lag p50  p95    max    received/sent   receiver CPU  peak RSS  load
    256    direct  0.17 s   0.25 s 0.38 s  7,936/7,936     3.8 %         65 MiB    8.3
    1,024  direct  0.81 s   1.74 s 2.56 s  31,744/31,744   15 %          141 MiB   9.0
    2,048  direct  2.2 s    6.3 s  6.7 s   63,488/63,488   29 %          243 MiB   11.5
    2,048  relay   13.4 s   17.6 s 18.9 s  63,488/63,488   20 %          249 MiB   13.8

Again once the machine was quieter (load average 0.7 to 2 before each run; the senders and the
receiver still share its 2 cores):

    256    direct  0.12 s   0.22 s 0.29 s  8,192/8,192     2.6 %         65 MiB
    1,024  direct  0.34 s   1.76 s 2.48 s  32,768/32,768   13 %          142 MiB
    2,048  direct  0.47 s   1.15 s 1.51 s  65,536/65,536   30 %          242 MiB
    2,048  relay   0.47 s   1.32 s 1.73 s  65,536/65,536   31 %          241 MiB

Nothing was lost or refused at any size. Before, the lag at 2,048 ranks was the live analysis:
a snapshot of 2,048 rows cost about 100-150 ms of CPU (``live_view.bucket_views`` for every row),
and the collectives check compared every rank's latest 64 steps at every feed, so a step cost
more than a second of CPU once the history filled. After, the receiver's 24 % of a core is the
listener (2 s of 33) and the watcher (6 s: a step's arrivals and blame, the rows of ranks that
moved); the lag left under load is the share of the two cores the other work leaves it. (The
relay sends a hello before every record here, as it does when the ranks' lines interleave.)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Where ``ddpdoctor`` is imported from: this checkout, or the one ``--baseline`` names (set for
#: the spawned receiver and senders, which import this module again).
TREE_ENV = "STREAM_SCALE_TREE"
TREE = Path(os.environ.get(TREE_ENV) or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(TREE))
sys.path.insert(0, str(TREE / "tui"))

from bench.synth import header, layout, step_record
from ddpdoctor.events import End, encode
from ddpdoctor.events.wire import Hello, encode_hello, encode_stats

WARMUP_S = 3.0


def _hello(rank: int, relay: bool) -> bytes:
    return encode_hello(Hello(rank=rank, run="bench", host=f"node{rank // 8:03d}", pid=10_000 + rank, relay=relay))


def sender(
    ranks: list[int], world: int, port: int, rate: float, seconds: float, t0: float, per_node: int, relay: bool
) -> None:
    """One process's ranks: connect, say hello, send a header, then a step per rank at ``rate``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a socket per rank
    groups = [ranks[i : i + per_node] for i in range(0, len(ranks), per_node)] if relay else [[r] for r in ranks]
    socks: list[socket.socket] = []
    for group in groups:
        for attempt in range(50):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                break
            except OSError:
                time.sleep(0.1 * (attempt + 1))
        else:
            raise RuntimeError("cannot connect")
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        for r in group:
            buf += _hello(r, relay) + encode_stats(0, 0) + encode(header(r, world))
        s.sendall(buf)
        socks.append(s)
    sent = {r: 1 for r in ranks}
    steps = int(seconds * rate)
    template = {r: step_record(r, world, 0) for r in ranks}
    for k in range(steps):
        due = t0 + k / rate
        delay = due - time.time()
        if delay > 0:
            time.sleep(delay)
        for s, group in zip(socks, groups, strict=True):
            buf = bytearray()
            for r in group:
                rec = template[r]
                rec.step, rec.t0_wall_ns = k, int(due * 1e9)
                if relay:
                    buf += _hello(r, relay)
                buf += encode(rec)
                sent[r] += 1
                if k % 10 == 9:
                    buf += encode_stats(sent[r], 0)
            s.sendall(buf)
    for s, group in zip(socks, groups, strict=True):  # the ranks end cleanly: their end record, their totals
        buf = bytearray()
        for r in group:
            end = End(rank=r, t_mono_ns=0, t_wall_ns=time.time_ns(), steps=steps, reason="close")
            buf += (_hello(r, relay) if relay else b"") + encode(end) + encode_stats(sent[r] + 1, 0)
        s.sendall(buf)
    time.sleep(2.0)
    for s in socks:
        s.close()


class _Target:
    """Stands in for the app: keeps each snapshot's view step and when it was posted."""

    def __init__(self) -> None:
        self.shown: dict[int, float] = {}

    def post_message(self, message: Any) -> None:
        snap = getattr(message, "snapshot", None)
        step = getattr(snap, "view_step", None)
        if step is not None and step not in self.shown:
            now = time.time()
            for k in range(min(self.shown, default=step), step + 1):
                self.shown.setdefault(k, now)


def _thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds (user + system) one thread of this process used so far (Linux)."""
    try:
        fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    """``fn`` that appends the CPU seconds of its calling thread each call takes to ``into``."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.thread_time() - t)

    return timed


def receiver(conn: Any, ranks: int, seconds: float) -> None:
    from ddpdoctor.analysis.live_run import LiveRun
    from ddpdoctor.stream.source import StreamSource
    from ddpdoctor_tui.watcher import Watcher

    # the watcher thread's CPU per snapshot and per batch fed (the same code before and after)
    snap_cpu: list[float] = []
    feed_cpu: list[float] = []
    LiveRun.snapshot = _timed(LiveRun.snapshot, snap_cpu)  # type: ignore[method-assign]
    LiveRun.feed = _timed(LiveRun.feed, feed_cpu)  # type: ignore[method-assign]
    source = StreamSource("127.0.0.1", 0)
    target = _Target()
    watcher = Watcher(source, target)  # type: ignore[arg-type]
    conn.send(source.port)
    t_start = conn.recv()
    thread = watcher  # (the TUI's watcher thread, as the app starts it)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    thread.start()
    deadline = t_start + seconds + 20
    steps = int(seconds)
    while time.time() < deadline and len(target.shown) < steps:
        time.sleep(0.2)
    lis = source.listener
    listener_cpu = _thread_cpu_s(lis._thread)
    watcher_cpu = _thread_cpu_s(watcher)
    watcher.stop()
    thread.join(10)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    conn.send(
        {
            "shown": target.shown,
            "received": sum(p.received for p in lis.peers.values()),
            "peers": len(lis.peers),
            "problems": lis.health().problems(),
            "cpu_s": cpu,
            "listener_cpu_s": listener_cpu,
            "watcher_cpu_s": watcher_cpu,
            "snapshot_cpu_s": snap_cpu,
            "feed_cpu_s": sum(feed_cpu),
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    )


def analysis(conn: Any, ranks: int, steps: int, polls: int) -> None:
    """The live analysis alone, no sockets: ``steps`` steps of ``ranks`` ranks fed to a ``LiveRun``
    in ``polls`` batches a step (as the watcher's polls take them), a snapshot after each; sends
    the CPU seconds of every feed and snapshot. CPU time, not wall: robust to the machine's load."""
    from ddpdoctor.analysis.live_run import LiveRun
    from ddpdoctor.runlog.source import RankRecord

    live = LiveRun()
    live.feed(
        [RankRecord(r, 0, header(r, ranks)) for r in range(ranks)] + [RankRecord(r, 0, layout(r)) for r in range(ranks)]
    )
    feeds, snaps = [], []
    for k in range(steps):
        batch = [RankRecord(r, 0, step_record(r, ranks, k)) for r in range(ranks)]
        for i in range(polls):
            t = time.thread_time()
            live.feed(batch[i * ranks // polls : (i + 1) * ranks // polls])
            t1 = time.thread_time()
            live.snapshot()
            feeds.append(t1 - t)
            snaps.append(time.thread_time() - t1)
    conn.send((feeds, snaps))


def analysis_once(ranks: int, steps: int, polls: int, tree: Path | None = None) -> dict[str, Any]:
    """``analysis`` in a process of its own, on this checkout's ddpdoctor or ``tree``'s."""
    os.environ[TREE_ENV] = str(tree or TREE)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=analysis, args=(there, ranks, steps, polls))
    proc.start()
    try:
        if not here.poll(3600):
            raise RuntimeError("the analysis gave no result")
        feeds, snaps = here.recv()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)

    def q(values: list[float], share: float) -> float:
        return round(1000 * sorted(values)[int(share * (len(values) - 1))], 1)

    late = len(feeds) // 2  # the second half: the history filled as in a long run (64 steps and more)
    return {
        "code": "baseline" if tree else "this",
        "ranks": ranks,
        "steps": steps,
        "polls_per_step": polls,
        "cpu_ms_per_step": round(1000 * (sum(feeds) + sum(snaps)) / steps, 1),
        "cpu_ms_per_step_second_half": round(1000 * (sum(feeds[late:]) + sum(snaps[late:])) / (steps - steps // 2), 1),
        "feed_cpu_ms_p50": q(feeds, 0.5),
        "feed_cpu_ms_p95": q(feeds, 0.95),
        "snapshot_cpu_ms_p50": q(snaps, 0.5),
        "snapshot_cpu_ms_p95": q(snaps, 0.95),
        "load_avg": os.getloadavg()[0],
    }


def run_once(
    ranks: int, seconds: float, rate: float, relay: bool, per_node: int, senders: int, tree: Path | None = None
) -> dict[str, Any]:
    """One receiver and its senders, on this checkout's ddpdoctor or ``tree``'s."""
    os.environ[TREE_ENV] = str(tree or TREE)  # (the spawned processes import this module again)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    rec = ctx.Process(target=receiver, args=(there, ranks, seconds * rate))
    rec.start()
    procs = []
    try:
        port = here.recv()
        t0 = time.time() + 3.0 + ranks / 1000  # everyone connected before the first step is due
        here.send(t0)
        share = [list(range(i, ranks, senders)) for i in range(senders)]
        if relay:  # a node's ranks together
            nodes = [list(range(n, min(n + per_node, ranks))) for n in range(0, ranks, per_node)]
            share = [[r for node in nodes[i::senders] for r in node] for i in range(senders)]
        for part in share:
            p = ctx.Process(target=sender, args=(part, ranks, port, rate, seconds, t0, per_node, relay))
            p.start()
            procs.append(p)
        for p in procs:
            p.join(seconds + 60)
        if not here.poll(seconds + 60):
            raise RuntimeError("the receiver gave no result")
        got = here.recv()
    finally:
        for p in [*procs, rec]:
            if p.is_alive():
                p.kill()
            p.join(10)
    shown = {int(k): v for k, v in got["shown"].items()}
    steps = int(seconds * rate)
    lags = [shown[k] - (t0 + k / rate) for k in range(steps) if k / rate >= WARMUP_S and k in shown]
    missing = [k for k in range(steps) if k not in shown]
    sent = ranks * (steps + 2)  # header, steps, end
    q = statistics.quantiles(lags, n=20, method="inclusive") if len(lags) >= 2 else [float("nan")] * 19
    snaps = sorted(got["snapshot_cpu_s"]) or [float("nan")]
    return {
        "code": "baseline" if tree else "this",
        "ranks": ranks,
        "mode": "relay" if relay else "direct",
        "lag_p50_s": statistics.median(lags) if lags else None,
        "lag_p95_s": q[18],
        "lag_max_s": max(lags) if lags else None,
        "steps_never_shown": len(missing),
        "records_sent": sent,
        "records_received": got["received"],
        "rank_streams": got["peers"],
        "receiver_counted": got["problems"],
        "receiver_cpu_pct": round(100 * got["cpu_s"] / (seconds + 3), 1),
        # where the receiver's CPU went: the listener thread (sockets, decoding), the watcher
        # thread (the live analysis: feeding records, taking snapshots), per snapshot
        "listener_cpu_s": round(got["listener_cpu_s"], 2),
        "watcher_cpu_s": round(got["watcher_cpu_s"], 2),
        "feed_cpu_s": round(got["feed_cpu_s"], 2),
        "snapshots": len(got["snapshot_cpu_s"]),
        "snapshot_cpu_ms_p50": round(1000 * snaps[len(snaps) // 2], 1),
        "snapshot_cpu_ms_p95": round(1000 * snaps[int(0.95 * (len(snaps) - 1))], 1),
        "receiver_rss_mib": round(got["rss_mib"]),
        "load_avg": os.getloadavg()[0],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="256,1024,2048")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--mode", choices=["direct", "relay"], default="direct")
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--senders", type=int, default=4)
    ap.add_argument(
        "--baseline",
        type=Path,
        help="another checkout (e.g. `git worktree add /tmp/base HEAD~3`): each size is run on its receiver "
        "and on this one's in turn, --pairs times, so both see the same load",
    )
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument(
        "--analysis",
        type=int,
        metavar="STEPS",
        help="time the live analysis alone (no sockets) over STEPS steps: CPU per step, per feed, per snapshot",
    )
    args = ap.parse_args()
    trees: list[Path | None] = [args.baseline.resolve(), None] if args.baseline else [None]
    for n in (int(r) for r in args.ranks.split(",")):
        for i in range(args.pairs):
            for tree in trees if i % 2 == 0 else trees[::-1]:  # alternate which goes first
                if args.analysis:
                    out = analysis_once(n, args.analysis, round(5 / args.rate), tree)
                else:
                    out = run_once(n, args.seconds, args.rate, args.mode == "relay", args.per_node, args.senders, tree)
                print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
