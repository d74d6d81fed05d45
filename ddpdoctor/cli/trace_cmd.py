"""``ddpdoctor trace``: a run as a Chrome/Perfetto trace."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddpdoctor.analysis.trace import chrome_trace
from ddpdoctor.cli.model_option import add_ddp_argument, add_job_argument
from ddpdoctor.runlog import load_run


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("trace", help="write a Chrome/Perfetto trace of a run dir")
    p.add_argument("run_dir", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True, help="the trace file to write (.json)")
    add_ddp_argument(p)
    add_job_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    trace = chrome_trace(load_run(args.run_dir, ddp=args.ddp, job=args.job))
    args.output.write_text(json.dumps(trace))
    print(f"wrote {len(trace['traceEvents'])} events to {args.output} (open it in https://ui.perfetto.dev)")
    return 0
