"""``ddpdoctor watch``: the live terminal view over a run dir (tailed, or replayed when finished) or a stream."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddpdoctor.analysis.live_run import HISTORY
from ddpdoctor.cli.model_option import add_ddp_argument
from ddpdoctor.events.wire import parse_endpoint
from ddpdoctor.runlog.source import DirSource, RecordSource

#: Bytes read per rank file per poll: catching up on a long run shows progress instead of a
#: blank screen until every file is read.
POLL_BYTES = 1 << 20


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("watch", help="live terminal view of a run dir or a streamed run")
    p.add_argument("run_dir", type=Path, nargs="?", help="the run dir to watch (being written, or finished)")
    p.add_argument("--listen", metavar="HOST:PORT", help="receive a streamed run (ddpdoctor run --endpoint HOST:PORT)")
    p.add_argument("--token", help="shared secret the senders must present (stream only)")
    p.add_argument(
        "--history",
        type=int,
        default=HISTORY,
        help=f"steps kept per rank, to step back over (default {HISTORY}; memory grows with it)",
    )
    p.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="also serve the live state for Prometheus on http://HOST:PORT/metrics",
    )
    add_ddp_argument(p)
    p.set_defaults(func=run)


def open_source(run_dir: Path | None, listen: str | None, token: str | None = None) -> RecordSource:
    """The record source the command line names (a RunDirError or ValueError says what is wrong)."""
    if listen is not None:
        host, port = parse_endpoint(listen, listen=True, what="--listen")
        from ddpdoctor.stream.source import StreamSource  # sockets only when a stream is asked for

        return StreamSource(host, port, token=token)
    if run_dir is None:
        raise ValueError("give a run dir to watch, or --listen HOST:PORT")
    # a run torchrun may restart keeps each attempt in attempt-N: the source follows the latest
    return DirSource(run_dir, max_bytes_per_poll=POLL_BYTES)


def run(args: argparse.Namespace) -> int:
    if args.run_dir is not None and args.listen is not None:
        print("ddpdoctor watch: give a run dir or --listen, not both", file=sys.stderr)
        return 2
    try:
        source = open_source(args.run_dir, args.listen, args.token)
    except (ValueError, OSError) as exc:
        print(f"ddpdoctor watch: {exc}", file=sys.stderr)
        return 2
    from ddpdoctor_tui import WatchApp  # textual only when the UI is actually wanted

    app = WatchApp(source, history=max(args.history, 20), ddp=args.ddp)
    metrics = None
    if args.metrics is not None:
        from ddpdoctor.cli.metrics_server import MetricsServer

        try:  # the snapshot the screen shows (frozen, so reading it from the server's thread is safe)
            metrics = MetricsServer(args.metrics, lambda: app.snapshot)
        except (ValueError, OSError) as exc:
            source.close()
            print(f"ddpdoctor watch: {exc}", file=sys.stderr)
            return 2
    try:
        app.run()
    finally:
        if metrics is not None:
            metrics.close()
    return 0
