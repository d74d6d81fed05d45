"""``ddpdoctor report``: post-mortem analysis of a run dir (works on a run still being written)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddpdoctor.analysis import analyze, at_least
from ddpdoctor.cli.model_option import add_ddp_argument, add_job_argument
from ddpdoctor.cli.render_text import ALL_RANKS_UP_TO, render, render_markdown
from ddpdoctor.runlog import load_run


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report", help="post-mortem analysis of a run dir")
    p.add_argument("run_dir", type=Path, help="the run dir (holds rank-NNNNN.jsonl files)")
    p.add_argument(
        "--format",
        choices=["text", "json", "markdown", "html"],
        default="text",
        help="html: one self-contained page with plots, readable offline (use with -o)",
    )
    p.add_argument("-o", "--output", type=Path, help="write the report to this file instead of stdout")
    p.add_argument(
        "--all-ranks",
        action="store_true",
        help="every rank's row in the per-rank table (by default a run of more than "
        f"{ALL_RANKS_UP_TO} ranks shows the ranks out of line, the rest summarised; JSON always has every rank)",
    )
    add_ddp_argument(p)
    add_job_argument(p)
    p.add_argument("--fail-on", choices=["warning", "error"], help="exit 1 if a finding this severe or worse exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_log = load_run(args.run_dir, max_steps="auto", ddp=args.ddp, job=args.job)
    report = analyze(run_log)
    if args.format == "html":
        from ddpdoctor.analysis.plot_data import plot_data
        from ddpdoctor.cli.render_html import render_report_html  # plotly only when a page is wanted

        text = render_report_html(report, plot_data(run_log), all_ranks=args.all_ranks)
    elif args.format == "json":
        text = json.dumps(report.to_dict(), indent=2) + "\n"
    elif args.format == "markdown":
        text = render_markdown(report, all_ranks=args.all_ranks)
    else:
        text = render(report, all_ranks=args.all_ranks)
    if args.output is not None:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    if args.fail_on and at_least(report.findings, args.fail_on):
        return 1
    return 0
