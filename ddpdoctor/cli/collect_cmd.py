"""``ddpdoctor collect --listen HOST:PORT --run-dir DIR``: streamed ranks -> the usual run-dir layout.

Every rank streaming to it (``ddpdoctor run --endpoint HOST:PORT``) gets its
``rank-NNNNN.jsonl`` in DIR (in ``attempt-N/`` for an elastic run), written line for line as
the rank's own file sink writes it, so ``ddpdoctor report DIR`` and ``trace`` work on it. It runs
until SIGINT or SIGTERM. A stream is a copy: records the senders dropped are missing here (the
count is printed), the ranks' local files have them all. What the receiver refused or lost
(connections over its limit, streams closed early, records lost in transit) is printed at the
end and written to ``receiver.json`` in DIR, where ``ddpdoctor report`` reads it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, BinaryIO

from ddpdoctor.cli.model_option import add_ddp_argument
from ddpdoctor.events.layout import TOKEN_ENV, rank_file_path
from ddpdoctor.events.line_index import LineIndexer
from ddpdoctor.events.wire import parse_endpoint
from ddpdoctor.runlog.receiver import write_receiver_health
from ddpdoctor.stream.listener import MAX_CONNECTIONS, Peer, StreamLine, StreamListener

#: How often received lines are written out (and files flushed).
WRITE_INTERVAL_S = 0.2


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "collect",
        help="receive streamed ranks and write them as a run dir",
        description="Receive the streams of `ddpdoctor run --endpoint HOST:PORT` and write the usual "
        "run-dir layout, for `ddpdoctor report` later. Stops on SIGINT/SIGTERM.",
    )
    p.add_argument(
        "--listen",
        required=True,
        metavar="HOST:PORT",
        help="address to listen on (loopback unless a token is set; port 0 picks a free one)",
    )
    p.add_argument("--run-dir", type=Path, required=True, help="where the rank files are written")
    p.add_argument("--token", default=None, help=f"shared secret the senders must present (default: ${TOKEN_ENV})")
    p.add_argument(
        "--metrics", metavar="HOST:PORT", help="serve the live state for Prometheus on http://HOST:PORT/metrics"
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        metavar="N",
        help="streams accepted at once, one per rank (default %(default)s, capped by the open-files "
        "limit); beyond it connections are refused and counted",
    )
    add_ddp_argument(p)  # which model --metrics follows (every model's stream is written)
    p.set_defaults(func=run)


class Collector:
    """Writes what a listener receives into ``run_dir``: one file per rank (and attempt), indexed
    as a rank's own writer indexes it (``sinks.line_index``), so a report of it seeks too."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.run_name: str | None = None
        self.records = 0
        self.other_runs = 0
        self._files: dict[tuple[int | None, int, int], tuple[BinaryIO, LineIndexer | None, bytearray]] = {}

    def path(self, peer: Peer) -> Path:
        return rank_file_path(self.run_dir, peer.rank, peer.ddp, peer.attempt)

    def write(self, lines: list[StreamLine]) -> None:
        touched = set()
        for line in lines:
            peer = line.peer
            if self.run_name is None:
                self.run_name = peer.run
            elif peer.run != self.run_name:  # one collector, one run: never mix two runs' ranks
                if self.other_runs == 0:
                    print(
                        f"ddpdoctor collect: ignoring run {peer.run!r} (collecting {self.run_name!r})",
                        file=sys.stderr,
                        flush=True,
                    )
                self.other_runs += 1
                continue
            key = (peer.attempt, peer.rank, peer.ddp)
            entry = self._files.get(key)
            if entry is None:
                entry = self._files[key] = self._open(self.path(peer))
            buf, index, record = entry[2], entry[1], line.record
            mark = len(buf)
            buf += line.raw
            if index is not None:
                index.note_record(buf, mark, record)
            touched.add(key)
            self.records += 1
        for key in touched:
            self._write(self._files[key], final=False)

    @staticmethod
    def _open(path: Path) -> tuple[BinaryIO, LineIndexer | None, bytearray]:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "ab")  # noqa: SIM115 - kept open for the run
        try:
            index: LineIndexer | None = LineIndexer(path, os.fstat(f.fileno()).st_size)
        except OSError:
            index = None
        return f, index, bytearray()

    @staticmethod
    def _write(entry: tuple[BinaryIO, LineIndexer | None, bytearray], final: bool) -> None:
        f, index, buf = entry
        before, after = index.wrap(len(buf), final) if index is not None else (b"", b"")
        f.write(before + bytes(buf) + after)
        f.flush()
        buf.clear()

    def close(self) -> None:
        for entry in self._files.values():
            self._write(entry, final=True)
            entry[0].close()
        self._files.clear()


def _metrics(address: str | None, listener: StreamListener, ddp: int = 0) -> tuple[Any, Any]:
    """``--metrics``: a live state of DDP model ``ddp`` fed beside the files, served for
    Prometheus (None, None without it)."""
    if address is None:
        return None, None
    from ddpdoctor.cli.metrics_server import LiveFeed, MetricsServer

    feed = LiveFeed(listener, ddp=ddp)
    return feed, MetricsServer(address, feed.snapshot)


def run(args: argparse.Namespace) -> int:
    try:
        host, port = parse_endpoint(args.listen, listen=True, what="--listen")
        listener = StreamListener(host, port, args.token, max_connections=max(1, args.max_connections))
    except (ValueError, OSError) as exc:  # malformed address, no token off loopback, port taken
        print(f"ddpdoctor collect: {exc}", file=sys.stderr)
        return 2
    collector = Collector(args.run_dir)
    try:
        feed, metrics = _metrics(args.metrics, listener, args.ddp)
    except (ValueError, OSError) as exc:
        listener.close()
        print(f"ddpdoctor collect: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    shown = f"[{host}]" if ":" in host else host
    print(f"ddpdoctor collect: listening on {shown}:{listener.port}, writing {args.run_dir}", flush=True)
    if metrics is not None:
        print(f"ddpdoctor collect: metrics on {metrics.url}", flush=True)
    try:
        while not stop.wait(WRITE_INTERVAL_S):
            lines = listener.take()
            collector.write(lines)
            if feed is not None:
                feed.feed(lines)
    finally:
        if metrics is not None:
            metrics.close()
        listener.close()
        collector.write(listener.take())
        collector.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    health = listener.health()
    write_receiver_health(args.run_dir, health)
    print(
        f"ddpdoctor collect: {collector.records} records in {args.run_dir} from {listener.summary()}",
        flush=True,
    )
    if health.refused or health.lost or health.dropped or health.closed:
        print(f"ddpdoctor collect: warning: the stream is incomplete: {', '.join(health.problems())}", flush=True)
    return 0
