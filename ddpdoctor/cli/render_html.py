"""The report and the comparison as one self-contained HTML file, plots drawn by plotly.js.

Everything is inlined: plotly.js (from the ``plotly`` Python package, no network), the style
sheet, the figures' data. The page fetches nothing, so it reads offline, as a CI artifact or an
attachment. Figures are plain plotly.js JSON specs (data + layout), built here from the
analysis' numbers and drawn by ``Plotly.newPlot``.
"""

from __future__ import annotations

import html
import json
from typing import Any

from ddpdoctor.analysis import Report
from ddpdoctor.analysis.compare import Comparison
from ddpdoctor.analysis.findings import SEVERITY_ORDER, Finding
from ddpdoctor.analysis.live_view import hosts_text
from ddpdoctor.analysis.plot_data import PlotData
from ddpdoctor.analysis.report import REPORTED
from ddpdoctor.analysis.sizes import human_bytes
from ddpdoctor.cli.render_compare import render_compare, run_ranks_text
from ddpdoctor.cli.render_text import (
    LISTED_OUT_OF_LINE,
    ended_text,
    many_ranks,
    out_of_line_lines,
    render,
    short_rank_lists,
    world_text,
)

#: Stacked per rank, in timeline order: together they make up the step.
STACKED = [
    ("forward", "#4c78a8"),
    ("buffer_sync", "#f58518"),
    ("backward", "#54a24b"),
    ("exposed_comm", "#e45756"),
    ("rest", "#b279a2"),
]
SEGMENT_COLORS = {
    "forward": "#4c78a8",
    "buffer_sync": "#f58518",
    "backward": "#54a24b",
    "bucket": "#e45756",
    "optimizer": "#b279a2",
}
CONFIG = {"displaylogo": False, "responsive": True}

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1f2328; background: #fff; }
main { max-width: 1200px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 22px; margin: 8px 0; } h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #d0d7de; }
h3 { font-size: 15px; margin: 14px 0 4px; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; margin: 6px 0; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; text-align: right; } th { background: #f6f8fa; }
td.l, th.l { text-align: left; }
pre { background: #f6f8fa; padding: 10px; overflow-x: auto; font-size: 12px; }
pre.fix { white-space: pre-wrap; overflow-wrap: anywhere; }  /* a fix is prose: it wraps, never hides */
.facts { color: #57606a; } .plot { width: 100%; min-height: 360px; }
.finding { border-left: 4px solid #d0d7de; padding: 4px 12px; margin: 10px 0; }
.finding.error { border-color: #cf222e; } .finding.warning { border-color: #bf8700; }
.finding.info { border-color: #0969da; }
.sev { font-weight: 600; text-transform: uppercase; font-size: 12px; }
.error .sev { color: #cf222e; } .warning .sev { color: #9a6700; } .info .sev { color: #0969da; }
.slower { color: #cf222e; font-weight: 600; } .faster { color: #1a7f37; font-weight: 600; }
.new { color: #cf222e; } .resolved { color: #1a7f37; }
"""


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _script_json(value: Any) -> str:
    """JSON safe inside a <script> element (no '</script>' can end it early)."""
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/").replace("<!--", "<\\!--")


def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs  # the library's own bundled copy, no network

    return str(get_plotlyjs())


class _Page:
    """Collects sections and figures, then writes the page."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.body: list[str] = []
        self.figures: list[tuple[str, dict[str, Any]]] = []

    def add(self, fragment: str) -> None:
        self.body.append(fragment)

    def figure(self, spec: dict[str, Any], height: int = 380) -> None:
        div = f"plot{len(self.figures)}"
        self.figures.append((div, spec))
        self.body.append(f'<div id="{div}" class="plot" style="height:{height}px"></div>')

    def html(self) -> str:
        calls = "\n".join(
            f"Plotly.newPlot({json.dumps(div)}, FIGS[{i}].data, FIGS[{i}].layout, CONFIG);"
            for i, (div, _) in enumerate(self.figures)
        )
        return "".join(
            [
                '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
                f"<title>{_esc(self.title)}</title>",
                '<meta name="viewport" content="width=device-width, initial-scale=1">',
                f"<style>{_CSS}</style>",
                f"<script>{_plotly_js()}</script>",
                "</head><body><main>\n",
                "\n".join(self.body),
                "\n</main>\n<script>\n",
                f"const FIGS = {_script_json([spec for _, spec in self.figures])};\n",
                f"const CONFIG = {_script_json(CONFIG)};\n",
                calls,
                "\n</script></body></html>\n",
            ]
        )


def _layout(title: str, xtitle: str, ytitle: str, **extra: Any) -> dict[str, Any]:
    return {
        "title": {"text": title},
        "xaxis": {"title": {"text": xtitle}},
        "yaxis": {"title": {"text": ytitle}},
        "margin": {"l": 70, "r": 20, "t": 50, "b": 50},
        "legend": {"orientation": "h", "y": -0.2},
        **extra,
    }


def _table(head: list[str], rows: list[list[str]], left: int = 1) -> str:
    th = "".join(f'<th class="{"l" if i < left else ""}">{_esc(h)}</th>' for i, h in enumerate(head))
    trs = "".join(
        "<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{c}</td>' for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _finding(f: Finding) -> str:
    where = f" · ranks {_esc(short_rank_lists(str(f.ranks)))}" if f.ranks else ""
    at = f" · from step {f.step}" if f.step is not None else ""
    evidence = json.dumps(f.evidence, indent=2, default=str)
    return (
        f'<div class="finding {_esc(f.severity)}"><span class="sev">{_esc(f.severity)}</span> '
        f'<code>{_esc(f.code)}</code>: <b>{_esc(short_rank_lists(f.title))}</b><span class="facts">{where}{at}</span>'
        f"<p>{_esc(short_rank_lists(f.detail))}</p><h3>Fix</h3><pre class='fix'>{_esc(f.fix)}</pre>"
        f"<details><summary>Evidence</summary><pre>{_esc(evidence)}</pre></details></div>"
    )


# -- the report -----------------------------------------------------------------------------------


def _step_figure(data: PlotData) -> dict[str, Any]:
    traces = [
        {
            "type": "scattergl" if len(s.steps) > 2000 else "scatter",
            "mode": "lines",
            "name": s.name,
            "x": s.steps,
            "y": s.ms,
        }
        for s in data.step_series
    ]
    title = "Step time per rank" + (
        " (min / median / max across ranks, and the slowest ranks)" if data.aggregated else ""
    )
    return {"data": traces, "layout": _layout(title, "step", "ms")}


def _phase_figure(report: Report, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Stacked phases of ``entries`` (every rank, or the ranks out of line and the others' medians)."""
    ranks = [f"rank {r['rank']}" if isinstance(r["rank"], int) else str(r["rank"]) for r in entries]
    traces = [
        {
            "type": "bar",
            "name": name,
            "x": ranks,
            "y": [r["medians_ms"].get(name) or 0.0 for r in entries],
            "marker": {"color": color},
        }
        for name, color in STACKED
    ]
    traces.append(
        {
            "type": "scatter",
            "mode": "markers",
            "name": "bucket_wait (inside the above)",
            "x": ranks,
            "y": [r["medians_ms"].get("bucket_wait") or 0.0 for r in entries],
            "marker": {"symbol": "diamond", "size": 9, "color": "#222"},
        }
    )
    return {"data": traces, "layout": _layout("Phase breakdown per rank (median ms)", "rank", "ms", barmode="stack")}


def _heatmap_figure(kind: str, hm: tuple[int, list[str], list[int], list[list[float]]]) -> dict[str, Any]:
    step, names, ranks, z = hm
    trace = {
        "type": "heatmap",
        "x": names,
        "y": [f"rank {r}" for r in ranks],
        "z": z,
        "colorscale": "YlOrRd",
        "reversescale": True,
        "zmin": 0,
        "colorbar": {"title": {"text": "ms late"}},
        "hovertemplate": "%{y}, %{x}: %{z:.3f} ms behind the earliest rank<extra></extra>",
    }
    what = "median step" if kind == "median" else "worst step (largest lateness)"
    return {
        "data": [trace],
        "layout": _layout(
            f"Arrival at each collective, {what}: step {step}",
            "collective (in arrival order)",
            "rank",
            yaxis={"autorange": "reversed", "title": {"text": "rank"}},
        ),
    }


def _timeline_figure(data: PlotData) -> dict[str, Any]:
    traces = []
    for kind, color in SEGMENT_COLORS.items():
        segs = [s for s in data.timeline if s.kind == kind]
        if not segs:
            continue
        traces.append(
            {
                "type": "bar",
                "orientation": "h",
                "name": kind if kind != "bucket" else "bucket: ready -> all-reduced",
                "y": [f"rank {s.rank}" for s in segs],
                "base": [s.start_ms for s in segs],
                "x": [round(s.end_ms - s.start_ms, 3) for s in segs],
                "text": [s.label for s in segs],
                "marker": {"color": color, "line": {"width": 1, "color": "#fff"}},
                "hovertemplate": "%{y} %{text}: %{base:.3f} + %{x:.3f} ms<extra></extra>",
            }
        )
    return {
        "data": traces,
        "layout": _layout(
            f"Step {data.timeline_step} per rank (aligned clocks)",
            "ms from the earliest rank's step start",
            "rank",
            barmode="overlay",
            yaxis={"autorange": "reversed", "title": {"text": "rank"}},
        ),
    }


def _rank_table(ranks: list[dict[str, Any]]) -> str:
    return _table(
        ["rank", "host", "status", "steps", *REPORTED],
        [
            [
                _esc(r["rank"]),
                _esc(r["host"] or "?"),
                _esc(r["status"]),
                _esc(r["steps"]),
                *(_ms(r["medians_ms"].get(c)) for c in REPORTED),
            ]
            for r in ranks
        ],
        left=3,
    )


def _others_medians(report: Report, listed: dict[Any, int]) -> dict[str, float | None]:
    """The median over the ranks not listed out of line of each reported phase."""
    out: dict[str, float | None] = {}
    for name in REPORTED:
        values = sorted(
            v for r in report.ranks if r["rank"] not in listed and (v := r["medians_ms"].get(name)) is not None
        )
        out[name] = values[len(values) // 2] if values else None
    return out


def render_report_html(report: Report, data: PlotData, all_ranks: bool = False) -> str:
    """The report as one self-contained HTML page (text content, plots, findings with evidence and
    fix): the findings, the ranks and hosts out of line, then the plots; every rank's row in a
    collapsed section where there are many (open with ``all_ranks``)."""
    run, stats = report.run, report.stats
    page = _Page(f"ddpdoctor report: {run['dir']}")
    page.add(
        f'<h1>ddpdoctor report</h1><p class="facts"><code>{_esc(run["dir"])}</code><br>'
        f"world size {_esc(world_text(run))}, backend {_esc(run['backend'])}, torch {_esc(run['torch'])}, "
        f"device {_esc(run['device'])}, {_esc(hosts_text(run['hosts']) or '?')}, {_esc(stats['steps'])} steps, "
        f"{_esc(ended_text(report, 'not finished'))}</p>"
    )
    findings = sorted(report.findings, key=lambda f: -SEVERITY_ORDER[f.severity])
    page.add(f"<h2>Findings ({len(findings)})</h2>")
    page.add("".join(_finding(f) for f in findings) or "<p>No findings.</p>")
    view = report.stats.get("out_of_line") or {}
    listed = [o for o in view.get("ranks", []) if not o["in_host"]]
    order = {o["rank"]: i for i, o in enumerate(listed[:LISTED_OUT_OF_LINE])}
    out_rows = sorted((r for r in report.ranks if r["rank"] in order), key=lambda r: order[r["rank"]])
    many = many_ranks(report)
    ahead = out_of_line_lines(report)
    if many or listed:
        page.add(f"<h2>Out of line ({len(listed)} of {len(report.ranks)} ranks, worst first)</h2>")
        page.add(
            "<ul>" + "".join(f"<li>{_esc(line)}</li>" for line in (ahead if many else ahead[: len(listed)])) + "</ul>"
        )
    if many and out_rows:
        page.add("<h3>Per-rank medians (ms) of the ranks out of line</h3>")
        page.add(_rank_table(out_rows))
    if many:
        opened = " open" if all_ranks else ""
        page.add(
            f"<details{opened}><summary>Per-rank medians (ms) of every rank ({len(report.ranks)})</summary>"
            f"{_rank_table(report.ranks)}</details>"
        )
    else:
        page.add("<h2>Per-rank medians (ms)</h2>")
        page.add(_rank_table(report.ranks))
    page.add("<h2>Step time</h2>")
    page.figure(_step_figure(data))
    page.add("<h2>Phase breakdown</h2>")
    entries = report.ranks
    if many:  # the ranks out of line beside the median of the others (every rank: the table above)
        within = (view.get("within_noise") or [{}])[0]
        others = {"rank": f"{within.get('count', 0)} others (median)", "medians_ms": _others_medians(report, order)}
        entries = [*out_rows, others]
    page.figure(_phase_figure(report, entries), height=max(360, 300 + 4 * len(entries)))
    page.add(
        '<h2>Bucket arrival</h2><p class="facts">How late each rank reaches each collective (the buffer '
        "broadcast, then each gradient bucket), behind the earliest rank, on aligned clocks. The ranks that "
        "are on time wait inside the collective for the late one.</p>"
    )
    if not data.heatmaps:
        page.add("<p>No step with bucket data from every rank (one rank, or no all-reduce logged).</p>")
    rows = max(len(hm[2]) for hm in data.heatmaps.values()) if data.heatmaps else 0
    for kind in ("median", "worst"):
        if kind in data.heatmaps:
            page.figure(_heatmap_figure(kind, data.heatmaps[kind]), height=min(1200, 220 + 18 * rows))
    if data.timeline:
        page.add("<h2>One step, per rank</h2>")
        page.figure(_timeline_figure(data), height=min(1400, 200 + 28 * len({s.rank for s in data.timeline})))
    buckets = stats.get("buckets") or []
    if buckets:
        page.add(f"<h2>Buckets ({len(buckets)})</h2>")
        page.add(
            _table(
                ["bucket", "size", "dtype", "params"],
                [[f"b{b['index']}", human_bytes(b["bytes"]), _esc(b["dtype"]), _esc(b["params"])] for b in buckets],
            )
        )
    page.add(f"<h2>Text report</h2><pre>{_esc(render(report))}</pre>")
    return page.html()


# -- the comparison -------------------------------------------------------------------------------


def render_compare_html(c: Comparison) -> str:
    """The comparison of two runs as one self-contained HTML page."""
    page = _Page(f"ddpdoctor compare: {c.base['dir']} -> {c.new['dir']}")
    page.add(
        f'<h1>ddpdoctor compare</h1><p class="facts">base <code>{_esc(c.base["dir"])}</code> '
        f"({_esc(run_ranks_text(c.base))}, {_esc(c.base['steps'])} steps) → new "
        f"<code>{_esc(c.new['dir'])}</code> ({_esc(run_ranks_text(c.new))}, {_esc(c.new['steps'])} steps)</p>"
    )
    page.add(
        '<h2>Phases</h2><p class="facts">Median over steps of the slowest rank\'s time; confidence that '
        "the change is not noise from a Mann-Whitney test over the two runs' steps.</p>"
    )
    rows = []
    for p in c.phases:
        if p.base_ms is None and p.new_ms is None:
            continue
        conf = "-" if p.confidence is None else f"{100 * p.confidence:.1f}%"
        pct = "-" if p.change_pct is None else f"{p.change_pct:+.1f}%"
        rows.append(
            [
                _esc(p.phase),
                _ms(p.base_ms),
                _ms(p.new_ms),
                "-" if p.change_ms is None else f"{p.change_ms:+.2f}",
                pct,
                conf,
                f'<span class="{_esc(p.verdict)}">{_esc(p.verdict)}</span>',
            ]
        )
    page.add(_table(["phase", "base ms", "new ms", "change ms", "change", "confidence", "verdict"], rows))
    shown = [p for p in c.phases if p.base_ms is not None or p.new_ms is not None]
    page.figure(
        {
            "data": [
                {
                    "type": "bar",
                    "name": "base",
                    "x": [p.phase for p in shown],
                    "y": [p.base_ms for p in shown],
                    "marker": {"color": "#9ecae9"},
                },
                {
                    "type": "bar",
                    "name": "new",
                    "x": [p.phase for p in shown],
                    "y": [p.new_ms for p in shown],
                    "marker": {"color": "#4c78a8"},
                },
            ],
            "layout": _layout("Median ms per phase", "phase", "ms", barmode="group"),
        }
    )
    if c.buckets:
        page.add("<h2>Buckets</h2>" + (f'<p class="facts">{_esc(c.buckets_note)}</p>' if c.buckets_note else ""))
        names = [f"b{b.index}" for b in c.buckets]
        page.figure(
            {
                "data": [
                    {
                        "type": "bar",
                        "name": "ready, base",
                        "x": names,
                        "y": [b.base_ready_ms for b in c.buckets],
                        "marker": {"color": "#a1d99b"},
                    },
                    {
                        "type": "bar",
                        "name": "ready, new",
                        "x": names,
                        "y": [b.new_ready_ms for b in c.buckets],
                        "marker": {"color": "#31a354"},
                    },
                    {
                        "type": "bar",
                        "name": "all-reduce, base",
                        "x": names,
                        "y": [b.base_allreduce_ms for b in c.buckets],
                        "marker": {"color": "#fdae6b"},
                    },
                    {
                        "type": "bar",
                        "name": "all-reduce, new",
                        "x": names,
                        "y": [b.new_allreduce_ms for b in c.buckets],
                        "marker": {"color": "#e6550d"},
                    },
                ],
                "layout": _layout(
                    "Per bucket: ready (ms after forward end) and all-reduce (ms)", "bucket", "ms", barmode="group"
                ),
            }
        )
    page.add("<h2>Findings</h2>")
    if not c.findings:
        page.add("<p>None in either run.</p>")
    else:
        page.add(
            _table(
                ["status", "severity", "code", "title", "fix"],
                [
                    [
                        f'<span class="{_esc(f.status)}">{_esc(f.status)}</span>',
                        _esc(f.severity),
                        f"<code>{_esc(f.code)}</code>",
                        _esc(f.title),
                        _esc(f.fix),
                    ]
                    for f in c.findings
                ],
                left=5,
            )
        )
    page.add(f"<h2>Text</h2><pre>{_esc(render_compare(c))}</pre>")
    return page.html()
