"""The report as text: what ``ddpdoctor report`` and the demo print."""

from __future__ import annotations

import re
from typing import Any

from ddpdoctor.analysis import Report
from ddpdoctor.analysis.findings import SEVERITY_ORDER
from ddpdoctor.analysis.groups import groups_text, ranks_text
from ddpdoctor.analysis.live_view import hosts_text
from ddpdoctor.analysis.report import SUMMARISED
from ddpdoctor.analysis.sizes import human_bytes

#: Up to this many ranks the report shows every rank's row; above, the ranks out of line, the rest
#: summarised and the hosts rolled up (``--all-ranks`` adds every rank's row; JSON has them all).
ALL_RANKS_UP_TO = 16
#: At most this many ranks and hosts out of line are listed one per line; the rest are counted.
LISTED_OUT_OF_LINE = 20

_COLUMNS = [
    ("step", "step"),
    ("forward", "fwd"),
    ("buffer_sync", "bufsync"),
    ("backward", "bwd"),
    ("allreduce", "allred"),
    ("bucket_wait", "wait"),
    ("exposed_comm", "exposed"),
    ("optimizer", "optim"),
    ("rest", "rest"),
]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def rank_table(ranks: list[dict[str, Any]]) -> list[str]:
    """Per-rank medians (ms) as aligned text lines."""
    head = ["rank", "host", "steps", "status"] + [short for _, short in _COLUMNS]
    rows = [head]
    for r in ranks:
        m = r["medians_ms"]
        rows.append(
            [str(r["rank"]), str(r["host"] or "?"), str(r["steps"]), r["status"]]
            + [_ms(m.get(name)) for name, _ in _COLUMNS]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return [
        "  ".join(
            cell.rjust(w) if i >= 2 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]


def _group_summary(summary: dict[str, Any], what: str) -> str:
    """ "254 ranks within noise: step 119.0 ms [118.9, 119.1], forward 24.2 ms, ..." """
    step = summary.get("step_ms")
    parts = [f"step {step[0]:.1f} ms [{step[1]:.1f}, {step[2]:.1f}]"] if step else []
    parts += [
        f"{words} {value:.1f} ms"
        for name, words in SUMMARISED
        if (value := (summary.get("medians_ms") or {}).get(name)) is not None
    ]
    n = summary["count"]
    return f"{n} {what}{'s' if n != 1 else ''} within noise: {', '.join(parts) or 'no steps'}"


def out_of_line_lines(report: Report, limit: int = LISTED_OUT_OF_LINE) -> list[str]:
    """The ranks and hosts out of line, worst first (at most ``limit``), then the rest of the ranks
    summarised per DDP group, then the hosts rolled up: one line each (no indent), what the text,
    Markdown and HTML reports lead with. Empty for a report without that view."""
    view = report.stats.get("out_of_line")
    if not view:
        return []
    entries: list[tuple[tuple[int, float], str]] = []
    for i, o in enumerate(view["ranks"]):
        if not o["in_host"]:
            host = f" ({o['host']})" if o.get("host") else ""
            entries.append(((i, 0.0), f"rank {o['rank']}{host}: {'; '.join(o['reasons'])}"))
    # a host after the ranks that cost the others more, before the ones that only stand out
    first_plain = next(
        (i for i, o in enumerate(view["ranks"]) if not o["status"] and not o["cost_ms"] and not o["in_host"]),
        len(view["ranks"]),
    )
    for j, h in enumerate(view["hosts"]):
        ranks = f" (ranks {ranks_text(h['ranks'])})" if h["ranks"] else ""
        entries.append(((first_plain, -1.0 + j / 1e6), f"host {h['host']}{ranks}: {'; '.join(h['reasons'])}"))
    entries.sort(key=lambda e: e[0])
    lines = [text for _, text in entries[:limit]]
    if len(entries) > limit:
        rest = [o["rank"] for o in view["ranks"] if not o["in_host"]][limit:]
        lines.append(f"... and {len(entries) - limit} more out of line (ranks {ranks_text(sorted(rest))}; --all-ranks)")
    groups = view["within_noise"]
    for g in groups:
        where = f" of ranks {g['group']}" if len(groups) > 1 else ""
        lines.append(_group_summary(g, "rank") + where)
    nodes = view["nodes"]
    if nodes["count"] >= 2:
        size = nodes["ranks_per_host"]
        each = f"{size[0]} ranks each" if size[0] == size[1] else f"{size[0]} to {size[1]} ranks each"
        named = ", ".join(h["host"] for h in view["hosts"])
        out = f"; {named} out of line (above)" if named else ""
        lines.append(
            f"{nodes['count']} hosts, {each}{out}; by host (medians of each host's ranks): "
            + _group_summary(nodes["within_noise"], "host")
        )
    return lines


def _stream_note(report: Report) -> str | None:
    """How many records the live stream lost, by rank (the rank files have them all)."""
    lost = {r["rank"]: r.get("stream_dropped", 0) for r in report.ranks if r.get("stream_dropped")}
    if receiver := report.run.get("stream_receiver"):
        return f"the receiver that wrote this run dir did not get everything: {', '.join(receiver)}"
    if not lost:
        return None
    ranks = ", ".join(f"{rank}: {n}" for rank, n in sorted(lost.items()))
    return (
        f"the live stream dropped {sum(lost.values())} records (by rank {ranks}; receiver slow or down); "
        "this report read them all from the rank files"
    )


def _lost_line(report: Report) -> str | None:
    """The time the other ranks lost waiting for each rank, when any rank cost them something."""
    lost = {r["rank"]: r.get("time_lost_for_others_ms") for r in report.ranks}
    if not any(lost.values()):
        return None
    text = ", ".join(f"rank {rank}: {_duration(ms or 0.0)}" for rank, ms in sorted(lost.items()))
    return f"time the others lost waiting for each rank (margins above the noise floor): {text}"


def _duration(ms: float) -> str:
    return f"{ms / 1000.0:.2f} s" if ms >= 1000.0 else f"{ms:.0f} ms"


def world_text(run: dict[str, Any]) -> str:
    """The world size, and each DDP group's ranks where DDP runs over subgroups of the world."""
    groups = groups_text(run.get("ddp_groups") or [])
    return f"{run['world_size']} {groups}" if groups else str(run["world_size"])


def models_text(run: dict[str, Any]) -> str | None:
    """Which DDP model is reported, where each process wrapped several (None: one)."""
    others = run.get("other_ddp_models") or []
    if not others:
        return None
    switches = ", ".join(f"--ddp {m}" for m in others)
    return (
        f"DDP model {run.get('ddp_model', 0)} of {len(others) + 1} wrapped in each process; "
        f"the others: ddpdoctor report {run['dir']} {switches}"
    )


def jobs_text(run: dict[str, Any]) -> str | None:
    """That the run dir held other jobs, left out (None: one job)."""
    earlier, later = run.get("earlier_jobs") or 0, run.get("later_jobs") or 0
    if not earlier and not later:
        return None
    jobs = earlier + later + 1
    which = f"the last of {jobs}" if not later else f"job {earlier} (from 0) of the {jobs}"
    return (
        f"{which} jobs that wrote this run dir one after another (each launch's ranks restart at step 0); "
        "the others are left out (--job K reads the K-th): give each launch its own --run-dir to keep them apart"
    )


def bare_text(stats: dict[str, Any]) -> str | None:
    """The steps without a backward of their own, when there are any (None: none)."""
    bare = stats.get("forwards_without_backward") or 0
    if not bare:
        return None
    return (
        f"{bare} of them had no backward of their own (a forward with grad on not followed by "
        "loss.backward(): an evaluation without torch.no_grad(), a model called twice before one "
        "backward, or a forward that raised and was caught, a skipped batch); the medians leave them out"
    )


def _ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def ended_text(report: Report, unfinished: str) -> str:
    """How the run ended: finished, or ``unfinished``; with the ranks an exception ended, or a
    signal (one that killed them, or a stop signal their own handler answered by exiting)."""
    if not report.run["finished"]:
        return unfinished
    failed = [r for r in report.ranks if r.get("status") == "failed"]
    if failed:
        ranks = _ranks_text([r["rank"] for r in failed])
        # a framework that answers SIGTERM by raising (Lightning's SIGTERMException) fails after it
        signals = sorted({r["end_signal"] for r in failed if r.get("end_signal")})
        after = f", after {' and '.join(signals)}" if signals else ""
        first = report.run.get("first_failed")
        which = f"; rank {first['rank']} first: {first['reason']}" if len(failed) > 1 and first else ""
        return f"ended, {ranks} failed (an exception ended training{after}{which})"
    terminated = [r for r in report.ranks if r.get("status") == "terminated"]
    if not terminated:
        return "finished"
    by_how: dict[str, list[int]] = {}
    for r in terminated:
        name = r.get("end_signal") or "a signal"
        how = (
            f"ended by {name}"
            if r.get("end_reason") == "signal"
            else f"caught {name} in the job's own handler and exited"
        )
        by_how.setdefault(how, []).append(r["rank"])
    parts = [f"{_ranks_text(ranks)} {how}" for how, ranks in by_how.items()]
    return f"ended by a signal ({'; '.join(parts)})"


def _hosts(run: dict[str, Any]) -> str:
    text = hosts_text(run["hosts"])
    return text if " hosts: " in text else f"hosts {text or '?'}"


def _findings(report: Report) -> list[str]:
    if not report.findings:
        return ["No findings."]
    lines = [f"Findings ({len(report.findings)}):"]
    for f in sorted(report.findings, key=lambda f: -SEVERITY_ORDER[f.severity]):
        where = f" ranks {_finding_ranks(f.ranks)}" if f.ranks else ""
        at = f" from step {f.step}" if f.step is not None else ""
        fix = f.fix.replace("\n", "\n           ")
        lines += [
            f"  [{f.severity}] {f.code}: {short_rank_lists(f.title)}{where}{at}",
            *("      " + line for line in short_rank_lists(f.detail).splitlines()),
            f"      fix: {fix}",
        ]
    return lines


#: A list of ranks longer than this is written in ranges ("0-199,201-2047 (2047 ranks)").
LISTED_RANKS = 8
_RANK_LIST = re.compile(r"\[(\d+(?:, \d+){" + str(LISTED_RANKS) + r",})\]")


def _finding_ranks(ranks: list[int]) -> str:
    """A finding's ranks: as a list up to a few, else in ranges (a finding may name hundreds)."""
    return str(ranks) if len(ranks) <= LISTED_RANKS else f"{ranks_text(sorted(ranks))} ({len(ranks)} ranks)"


def short_rank_lists(text: str) -> str:
    """``text`` with every long list of ranks ("ranks [0, 1, 2, ..., 2047]" in a finding's words)
    in ranges: at 2,048 ranks one such list would be a screen of numbers."""
    return _RANK_LIST.sub(lambda m: _finding_ranks([int(v) for v in m.group(1).split(", ")]), text)


def many_ranks(report: Report) -> bool:
    """Whether the report is at a size where it shows the ranks out of line instead of every rank."""
    return len(report.ranks) > ALL_RANKS_UP_TO


def render(report: Report, all_ranks: bool = False) -> str:
    """The whole report as readable text: the run, the findings, the ranks and hosts out of line
    and the rest summarised, then every rank's row where there are few (or ``all_ranks``)."""
    run, stats = report.run, report.stats
    opts = run.get("ddp_options") or {}
    lines = [
        f"ddpdoctor report: {run['dir']}",
        f"  world size {world_text(run)}, backend {run['backend']}, torch {run['torch']}, "
        f"device {run['device']}, {_hosts(run)}",
        f"  {stats['steps']} steps, {ended_text(report, 'not finished (still running, or a rank died)')}",
        *([f"  {bare}"] if (bare := bare_text(stats)) else []),
        *([f"  {models}"] if (models := models_text(run)) else []),
        *([f"  {jobs}"] if (jobs := jobs_text(run)) else []),
        *(
            [f"  step statistics from every {run['steps_sampled_every']}th step of each rank and its last 128 steps"]
            if run.get("steps_sampled_every", 1) > 1
            else []
        ),
    ]
    if opts:
        lines.append(
            f"  DDP: bucket_cap_mb={opts.get('bucket_cap_mb'):.3g} "
            f"find_unused_parameters={opts.get('find_unused_parameters')} "
            f"static_graph={opts.get('static_graph')} broadcast_buffers={opts.get('broadcast_buffers')} "
            f"gradient_as_bucket_view={opts.get('gradient_as_bucket_view')} "
            f"comm_hook={opts.get('comm_hook') or 'default'}"
            if opts.get("bucket_cap_mb") is not None
            else f"  DDP: {opts}"
        )
    if run["missing_ranks"]:
        lines.append(f"  missing rank files: {run['missing_ranks']}")
    if run["corrupt_lines"] or run["unknown_lines"]:
        lines.append(f"  skipped {run['corrupt_lines']} corrupt and {run['unknown_lines']} unknown log lines")
    if stream := _stream_note(report):
        lines.append(f"  {stream}")
    lines += ["", *_findings(report)]
    many = many_ranks(report)
    ahead = out_of_line_lines(report)
    view = report.stats.get("out_of_line") or {}
    listed = [o for o in view.get("ranks", []) if not o["in_host"]]
    if many:
        n_hosts = view.get("nodes", {}).get("count", 0)
        hosts = view.get("hosts", [])
        in_hosts = sum(len(h["ranks"]) for h in hosts)
        lines += [
            "",
            f"Out of line, worst first: {len(listed)} of {len(report.ranks)} ranks on their own, "
            f"{len(hosts)} of {n_hosts} hosts ({in_hosts} ranks):",
        ]
        lines += ["  " + line for line in ahead]
    elif listed:
        lines += ["", "Out of line (worst first):"]
        lines += ["  " + line for line in ahead[: len(listed)]]
    if many and not all_ranks:
        shown = {o["rank"] for o in listed[:LISTED_OUT_OF_LINE]}
        rows = [r for r in report.ranks if r["rank"] in shown]
        order = {o["rank"]: i for i, o in enumerate(listed)}
        rows.sort(key=lambda r: order[r["rank"]])
        if rows:
            lines += ["", "Per-rank medians (ms) of the ranks out of line:"]
            lines += ["  " + line for line in rank_table(rows)]
        lines.append(f"  every rank's row: ddpdoctor report {report.run['dir']} --all-ranks (or --format json)")
    else:
        lines += ["", "Per-rank medians (ms):"]
        lines += ["  " + line for line in rank_table(report.ranks)]
        if not many and (lost := _lost_line(report)):
            lines.append(f"  {lost}")
    buckets = stats.get("buckets") or []
    if buckets:
        total = sum(b["bytes"] for b in buckets)
        sizes = ", ".join(human_bytes(b["bytes"]) for b in buckets)
        rebuilt = " (rebuilt after the first step)" if stats.get("layout_rebuilt") else ""
        lines += ["", f"Buckets: {len(buckets)}, {human_bytes(total)} per step{rebuilt}: {sizes}"]
    return "\n".join(lines) + "\n"


def render_markdown(report: Report, all_ranks: bool = False) -> str:
    """The report as Markdown (for CI summaries, issues, notebooks), in the text report's order."""
    run, stats = report.run, report.stats
    lines = [
        f"# ddpdoctor report: `{run['dir']}`",
        "",
        f"World size {world_text(run)}, backend {run['backend']}, torch {run['torch']}, device {run['device']}, "
        f"{stats['steps']} steps, {ended_text(report, 'not finished')}; {_hosts(run)}.",
    ]
    if run["missing_ranks"]:
        lines.append(f"Missing rank files: {run['missing_ranks']}.")
    for note in (bare_text(stats), models_text(run), jobs_text(run), _stream_note(report)):
        if note:
            lines.append(note[0].upper() + note[1:] + ".")
    if run["corrupt_lines"] or run["unknown_lines"]:
        lines.append(f"Skipped {run['corrupt_lines']} corrupt and {run['unknown_lines']} unknown log lines.")
    lines += ["", "## Findings", ""]
    if not report.findings:
        lines.append("No findings.")
    for f in sorted(report.findings, key=lambda f: -SEVERITY_ORDER[f.severity]):
        where = f", ranks {_finding_ranks(f.ranks)}" if f.ranks else ""
        at = f", from step {f.step}" if f.step is not None else ""
        lines += [
            f"### {f.severity}: `{f.code}`: {short_rank_lists(f.title)}",
            "",
            f"{short_rank_lists(f.detail)} ({f.code}{where}{at})",
            "",
            "Fix:",
            "",
            "```",
            f.fix,
            "```",
            "",
        ]
    many = many_ranks(report)
    view = report.stats.get("out_of_line") or {}
    listed = [o for o in view.get("ranks", []) if not o["in_host"]]
    ahead = out_of_line_lines(report)
    if many or listed:
        lines += ["", "## Out of line (worst first)", ""]
        lines += [f"- {line}" for line in (ahead if many else ahead[: len(listed)])]
    rows = report.ranks
    if many and not all_ranks:
        shown = {o["rank"] for o in listed[:LISTED_OUT_OF_LINE]}
        order = {o["rank"]: i for i, o in enumerate(listed)}
        rows = sorted((r for r in report.ranks if r["rank"] in shown), key=lambda r: order[r["rank"]])
    if rows:
        title = "Per-rank medians (ms)" + (" of the ranks out of line" if rows is not report.ranks else "")
        lines += [
            "",
            f"## {title}",
            "",
            "| rank | host | steps | status | " + " | ".join(short for _, short in _COLUMNS) + " |",
            "|---|---|---:|---|" + "---:|" * len(_COLUMNS),
        ]
        for r in rows:
            m = r["medians_ms"]
            lines.append(
                f"| {r['rank']} | {r['host'] or '?'} | {r['steps']} | {r['status']} | "
                + " | ".join(_ms(m.get(name)) for name, _ in _COLUMNS)
                + " |"
            )
    if many and not all_ranks:
        lines += ["", "Every rank's row: `--all-ranks`, or `--format json`."]
    return "\n".join(lines).rstrip() + "\n"
