"""The ``ddpdoctor`` command line."""

from __future__ import annotations

import argparse
import sys

from ddpdoctor.cli import (
    collect_cmd,
    compare_cmd,
    demo_cmd,
    export_cmd,
    report_cmd,
    run_cmd,
    trace_cmd,
    watch_cmd,
)
from ddpdoctor.runlog import RunDirError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpdoctor", description="See where DDP training time goes, per bucket and per rank."
    )
    parser.add_argument("--version", action="version", version="ddpdoctor 0.1.0")
    sub = parser.add_subparsers(dest="command", required=True)
    collect_cmd.add_parser(sub)
    compare_cmd.add_parser(sub)
    demo_cmd.add_parser(sub)
    export_cmd.add_parser(sub)
    report_cmd.add_parser(sub)
    run_cmd.add_parser(sub)
    trace_cmd.add_parser(sub)
    watch_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except RunDirError as exc:
        print(f"ddpdoctor {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
