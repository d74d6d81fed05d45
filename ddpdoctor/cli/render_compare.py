"""A comparison of two runs as text or markdown (``ddpdoctor compare``)."""

from __future__ import annotations

from typing import Any

from ddpdoctor.analysis.compare import CONFIDENCE, Comparison, PhaseChange
from ddpdoctor.analysis.groups import groups_text
from ddpdoctor.analysis.sizes import human_bytes


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _signed(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:+.2f}{unit}" if unit != "%" else f"{v:+.1f}%"


def _conf(p: PhaseChange) -> str:
    return "-" if p.confidence is None else f"{100 * p.confidence:.1f}%"


def _table(rows: list[list[str]], right_from: int = 1) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.rjust(w) if i >= right_from else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]


def phase_rows(c: Comparison) -> list[list[str]]:
    rows = [["phase", "base ms", "new ms", "change ms", "change", "confidence", "verdict"]]
    for p in c.phases:
        if p.base_ms is None and p.new_ms is None:
            continue
        rows.append(
            [
                p.phase,
                _ms(p.base_ms),
                _ms(p.new_ms),
                _signed(p.change_ms),
                _signed(p.change_pct, "%"),
                _conf(p),
                p.verdict,
            ]
        )
    return rows


def bucket_rows(c: Comparison) -> list[list[str]]:
    rows = [
        ["bucket", "base size", "new size", "base ready ms", "new ready ms", "base allreduce ms", "new allreduce ms"]
    ]
    for b in c.buckets:
        rows.append(
            [
                f"b{b.index}",
                human_bytes(b.base_bytes) if b.base_bytes is not None else "-",
                human_bytes(b.new_bytes) if b.new_bytes is not None else "-",
                _ms(b.base_ready_ms),
                _ms(b.new_ready_ms),
                _ms(b.base_allreduce_ms),
                _ms(b.new_allreduce_ms),
            ]
        )
    return rows


#: Above this many ranks, the text shows only the ranks whose step or wait moved most, most first
#: (``--all-ranks``: every rank, in rank order; JSON has all).
MAX_RANK_ROWS = 16


def _moved(r: dict[str, float | None]) -> float:
    def delta(a: float | None, b: float | None) -> float:
        return abs(b - a) if a is not None and b is not None else 0.0

    return max(delta(r["base_step_ms"], r["new_step_ms"]), delta(r["base_wait_ms"], r["new_wait_ms"]))


def rank_rows(c: Comparison, all_ranks: bool = False) -> list[list[str]]:
    """The per-rank table: every rank up to ``MAX_RANK_ROWS`` (or ``all_ranks``), else the ranks
    that moved most, most first."""
    rows = [["rank", "base step ms", "new step ms", "base wait ms", "new wait ms"]]
    ranks = c.ranks
    if len(ranks) > MAX_RANK_ROWS and not all_ranks:
        ranks = sorted(ranks, key=lambda r: (-_moved(r), r["rank"]))[:MAX_RANK_ROWS]
    for r in ranks:
        rows.append(
            [
                str(r["rank"]),
                _ms(r["base_step_ms"]),
                _ms(r["new_step_ms"]),
                _ms(r["base_wait_ms"]),
                _ms(r["new_wait_ms"]),
            ]
        )
    return rows


def _headline(c: Comparison) -> str:
    step = c.phase("step")
    if step is None or step.verdict == "n/a":
        return "step time: not enough steps in both runs to compare"
    if step.verdict == "same":
        return (
            f"step time: no change beyond noise ({_signed(step.change_pct, '%')}, "
            f"confidence {_conf(step)} < {100 * CONFIDENCE:.0f}%)"
            if step.change_pct is not None
            else "step time: no change beyond noise"
        )
    word = "SLOWER" if step.verdict == "slower" else "faster"
    return (
        f"step time: {word} by {_signed(step.change_ms)} ms ({_signed(step.change_pct, '%')}), confidence {_conf(step)}"
    )


def _where(c: Comparison) -> list[str]:
    moved = [p for p in c.phases if p.verdict in ("slower", "faster") and p.phase != "step"]
    moved.sort(key=lambda p: -abs(p.change_ms or 0.0))
    return [
        f"{p.phase} {p.verdict} by {_signed(p.change_ms)} ms ({_signed(p.change_pct, '%')}, confidence {_conf(p)})"
        for p in moved
    ]


def run_ranks_text(facts: dict[str, Any]) -> str:
    """One run's ranks, and its DDP groups where DDP runs over subgroups of the world."""
    groups = groups_text(facts.get("ddp_groups") or [])
    return f"{facts['world_size']} ranks {groups}" if groups else f"{facts['world_size']} ranks"


def _findings(c: Comparison) -> list[str]:
    lines = ["Findings"]
    if not c.findings:
        lines.append("  none in either run")
    for f in c.findings:
        sev = f.severity if f.base_severity in (None, f.severity) else f"{f.base_severity} -> {f.severity}"
        lines.append(f"  {f.status.upper():<9} [{sev}] {f.code}: {f.title}")
        if f.status == "new":
            lines.append(f"            fix: {f.fix}")
    return lines


def render_compare(c: Comparison, all_ranks: bool = False) -> str:
    """The comparison as plain text: the verdict and the findings first, then phases, buckets and
    ranks (above ``MAX_RANK_ROWS`` the ranks that moved most, unless ``all_ranks``)."""
    lines = [
        f"ddpdoctor compare: {c.base['dir']} (base) -> {c.new['dir']} (new)",
        f"  base: {run_ranks_text(c.base)}, {c.base['steps']} steps; "
        f"new: {run_ranks_text(c.new)}, {c.new['steps']} steps",
        "",
        _headline(c),
    ]
    lines += [f"  {w}" for w in _where(c)]
    lines += ["", *_findings(c)]
    lines += ["", "Phases (ms, median over steps of the slowest rank; confidence: Mann-Whitney over steps)"]
    lines += ["  " + row for row in _table(phase_rows(c))]
    if c.buckets:
        lines += ["", "Buckets (ready: ms after forward end; allreduce: ready to done)"]
        if c.buckets_note:
            lines.append(f"  note: {c.buckets_note}")
        lines += ["  " + row for row in _table(bucket_rows(c))]
    if c.ranks:
        more = len(c.ranks) > MAX_RANK_ROWS and not all_ranks
        which = f"; the {MAX_RANK_ROWS} of {len(c.ranks)} that moved most, most first" if more else ""
        lines += ["", f"Ranks (medians{which})"]
        lines += ["  " + row for row in _table(rank_rows(c, all_ranks))]
        if more:
            lines.append("  every rank: --all-ranks (or --format json)")
    return "\n".join(lines) + "\n"


def _md_table(rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return out


def render_compare_markdown(c: Comparison) -> str:
    """The comparison as markdown (e.g. a pull-request comment)."""
    lines = [
        "## ddpdoctor compare",
        "",
        f"`{c.base['dir']}` (base) → `{c.new['dir']}` (new)",
        "",
        f"**{_headline(c)}**",
        "",
    ]
    lines += [f"- {w}" for w in _where(c)]
    lines += ["", "### Findings", ""]
    if not c.findings:
        lines.append("none in either run")
    for f in c.findings:
        lines.append(f"- **{f.status}** `{f.code}` ({f.severity}): {f.title}")
    lines += [
        "",
        "### Phases",
        "",
        "ms, median over steps of the slowest rank; confidence from a Mann-Whitney test over the runs' steps",
        "",
    ]
    lines += _md_table(phase_rows(c))
    if c.buckets:
        lines += ["", "### Buckets", ""]
        if c.buckets_note:
            lines += [f"_{c.buckets_note}_", ""]
        lines += _md_table(bucket_rows(c))
    return "\n".join(lines) + "\n"
