"""``ddpdoctor compare BASE NEW``: two runs side by side, for before/after and CI gates."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddpdoctor.analysis import analyze
from ddpdoctor.analysis.compare import COMPARED, Comparison, compare
from ddpdoctor.cli.model_option import add_ddp_argument, add_job_argument
from ddpdoctor.cli.render_compare import MAX_RANK_ROWS, render_compare, render_compare_markdown
from ddpdoctor.runlog import load_run


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "compare",
        help="compare two run dirs: per phase, per bucket, findings",
        description="Compare two runs (BASE before a change, NEW after): per-phase medians with the "
        "change and a confidence that it is not noise, per-bucket times, findings new, "
        "resolved or unchanged.",
    )
    p.add_argument("base", type=Path, help="the run dir before the change")
    p.add_argument("new", type=Path, help="the run dir after the change")
    p.add_argument("--format", choices=["text", "json", "markdown", "html"], default="text")
    p.add_argument("-o", "--output", type=Path, help="write to this file instead of stdout")
    p.add_argument(
        "--all-ranks",
        action="store_true",
        help=f"every rank's row (by default, above {MAX_RANK_ROWS} ranks, the ranks whose step or wait moved most)",
    )
    p.add_argument(
        "--fail-on-regression",
        type=float,
        metavar="PCT",
        help="exit 1 when step time (or a --phase) got slower by more than PCT %% with confidence, "
        "or when NEW has a warning or error finding BASE did not have",
    )
    p.add_argument(
        "--phase",
        action="append",
        choices=COMPARED,
        metavar="PHASE",
        help=f"phase(s) --fail-on-regression watches (default: step); one of {', '.join(COMPARED)}",
    )
    add_ddp_argument(p)  # (the same model in both runs)
    add_job_argument(p)
    p.set_defaults(func=run)


def gate(c: Comparison, pct: float, phases: list[str] | None) -> list[str]:
    """Why a CI gate fails (empty: it passes)."""
    reasons = [
        f"{p.phase} slower by {p.change_pct:+.1f}% ({p.base_ms:.2f} -> {p.new_ms:.2f} ms, "
        f"confidence {100 * (p.confidence or 0):.1f}%)"
        for p in c.regressions(pct, phases or ["step"])
    ]
    reasons += [f"new {f.severity} finding {f.code}: {f.title}" for f in c.new_problems()]
    return reasons


def run(args: argparse.Namespace) -> int:
    base_run = load_run(args.base, max_steps="auto", ddp=args.ddp, job=args.job)
    new_run = load_run(args.new, max_steps="auto", ddp=args.ddp, job=args.job)
    c = compare(base_run, new_run, analyze(base_run), analyze(new_run))
    if args.format == "json":
        text = json.dumps(c.to_dict(), indent=2) + "\n"
    elif args.format == "markdown":
        text = render_compare_markdown(c)
    elif args.format == "html":
        from ddpdoctor.cli.render_html import render_compare_html

        text = render_compare_html(c)
    else:
        text = render_compare(c, all_ranks=args.all_ranks)
    if args.output is not None:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    if args.fail_on_regression is not None:
        reasons = gate(c, args.fail_on_regression, args.phase)
        for reason in reasons:
            print(f"ddpdoctor compare: regression: {reason}", file=sys.stderr)
        return 1 if reasons else 0
    return 0
