"""``ddpdoctor watch``: the live terminal view (a shell until its panels land)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ddpdoctor.runlog.run import check_run_dir


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("watch", help="live terminal view of a run dir")
    p.add_argument("run_dir", type=Path, nargs="?", help="the run dir to watch")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.run_dir is not None:
        check_run_dir(args.run_dir)
    from ddpdoctor_tui import WatchApp  # textual only when the UI is actually wanted

    WatchApp(args.run_dir).run()
    return 0
