"""``ddpdoctor export``: a run (finished or still being written) in the tools users already watch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddpdoctor.cli.model_option import add_ddp_argument, add_job_argument
from ddpdoctor.runlog import load_run


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("export", help="write a run dir as TensorBoard event files")
    p.add_argument("run_dir", type=Path, help="the run dir (holds rank-NNNNN.jsonl files)")
    p.add_argument(
        "--tensorboard",
        type=Path,
        required=True,
        metavar="DIR",
        help="write event files here (one TensorBoard run per rank, and one for the run): tensorboard --logdir DIR",
    )
    add_ddp_argument(p)
    add_job_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddpdoctor.integrations.tensorboard_export import ExportError, export_tensorboard

    run_log = load_run(args.run_dir, max_steps="auto", ddp=args.ddp, job=args.job)
    try:
        done = export_tensorboard(run_log, args.tensorboard)
    except ExportError as exc:
        print(f"ddpdoctor export: {exc}", file=sys.stderr)
        return 2
    every = "every step" if done.block == 1 else f"one point per {done.block} steps"
    print(
        f"wrote {len(done.ranks)} rank(s) x {done.points} point(s) ({every}), {done.scalars} values, "
        f"{done.findings} finding(s) to {done.directory}"
    )
    if done.corrupt_lines:
        print(f"skipped {done.corrupt_lines} unreadable line(s) of the rank files", file=sys.stderr)
    print(f"view it: tensorboard --logdir {done.directory}")
    return 0
