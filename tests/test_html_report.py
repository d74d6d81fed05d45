"""``ddpdoctor report --format html`` and ``compare --format html``: one self-contained page,
checked as a file and in a real headless Chromium (no console error, no network request, plots
drawn)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddpdoctor.analysis import analyze
from ddpdoctor.analysis.plot_data import plot_data
from ddpdoctor.cli.main import main
from ddpdoctor.runlog import load_run
from tests.headless_browser import chromium, coloured_fraction, open_page
from tests.zoo_runs import ZooRuns

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "zoo" / "constant_buffers.py"
#: What the page must stay under (plotly.js inlined is ~4.8 MB of it).
MAX_BYTES = 6_000_000

try:
    import websocket  # noqa: F401 - websocket-client, in the test extra: the DevTools protocol client

    _NO_BROWSER = None if chromium() is not None else "chromium not installed (apt-get install chromium)"
except ImportError:
    _NO_BROWSER = "websocket-client not installed (pip install -e '.[test]')"
needs_chromium = pytest.mark.skipif(_NO_BROWSER is not None, reason=str(_NO_BROWSER))

PLOTS_DRAWN = (
    "document.querySelectorAll('.plot').length > 0 && Array.from(document.querySelectorAll('.plot'))"
    ".every(d => d.classList.contains('js-plotly-plot') && d.querySelector('.main-svg'))"
)
PROBE = """({plots: Array.from(document.querySelectorAll('.plot')).map(d => ({
  id: d.id, svg: d.querySelectorAll('.main-svg').length, title: (d.querySelector('.gtitle') || {}).textContent || '',
  traces: d.querySelectorAll('.trace, .hm, .heatmaplayer image, .barlayer .point').length})),
  fixes: Array.from(document.querySelectorAll('.finding h3 + pre')).map(p => [p.scrollWidth, p.clientWidth])})"""
PLOT_AREAS = """Array.from(document.querySelectorAll('.plot .nsewdrag')).map(e => { const r = e.getBoundingClientRect();
  return {x: r.x + window.scrollX, y: r.y + window.scrollY, width: r.width, height: r.height}; })"""


#: Every forward sleeps this long (as in test_compare.py, whose runs of the script these are).
FORWARD_SLEEP_MS = "20"


def _run(zoo_runs: ZooRuns, *args: str) -> Path:
    proc, run_dir = zoo_runs.run(SCRIPT, "--forward-sleep-ms", FORWARD_SLEEP_MS, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def runs(zoo_runs: ZooRuns) -> dict[str, Path]:
    return {"base": _run(zoo_runs), "fixed": _run(zoo_runs, "--fixed")}


@pytest.fixture(scope="module")
def report_html(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("page") / "report.html"
    assert main(["report", str(runs["base"]), "--format", "html", "-o", str(out)]) == 0
    return out


def test_the_page_is_self_contained(report_html: Path) -> None:
    page = report_html.read_text()
    size = len(page.encode())
    assert size < MAX_BYTES, size
    assert "plotly.js v" in page  # the library, inlined (its own code names URLs in strings: not fetched,
    # which the browser test checks); the page around it references nothing the browser would fetch
    own = re.sub(r"<script>/\*\*\n\* plotly\.js.*?</script>", "", page, count=1, flags=re.S)
    assert len(own) < len(page) - 4_000_000
    assert not re.search(r"<(script|img|iframe)[^>]+src=", own)
    assert "<link" not in own and "@import" not in own
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", own)
    # the text report's content, the findings with evidence and fix, and every plot
    for text in (
        "Per-rank medians",
        "constant-buffers",
        "Evidence",
        "Fix",
        "broadcast_buffers=False",
        "Step time",
        "Phase breakdown",
        "Bucket arrival",
        "One step, per rank",
        "Text report",
    ):
        assert text in page, text
    assert page.count('class="plot"') == 5  # step time, phases, 2 heatmaps, timeline


def test_plot_data_from_a_real_run(runs: dict[str, Path]) -> None:
    run = load_run(runs["base"])
    data = plot_data(run)
    assert [s.name for s in data.step_series] == ["rank 0", "rank 1"]
    assert len(data.step_series[0].steps) >= 9
    assert all(ms > float(FORWARD_SLEEP_MS) for ms in data.step_series[0].ms)  # the forward's sleep is in
    assert set(data.heatmaps) == {"median", "worst"}
    step, names, ranks, z = data.heatmaps["worst"]
    assert names == ["bcast", "b0"] and ranks == [0, 1] and len(z) == 2 and len(z[0]) == 2
    # at each collective the earliest rank is 0 ms late; the worst step is at least as late as the median
    assert all(min(row[i] for row in z) == 0 for i in range(2))
    assert max(map(max, z)) >= max(map(max, data.heatmaps["median"][3]))
    kinds = {(s.rank, s.kind) for s in data.timeline}
    assert {(r, k) for r in (0, 1) for k in ("forward", "backward", "bucket", "buffer_sync", "optimizer")} <= kinds
    assert all(s.end_ms >= s.start_ms >= 0 for s in data.timeline)
    assert analyze(run).findings  # the page has a finding to show


@needs_chromium
def test_the_report_page_loads_offline_and_draws_its_plots(report_html: Path, tmp_path: Path) -> None:
    # (a narrow window, where a long fix line would run out of its box)
    result = open_page(report_html, PROBE, width=760, settle=PLOTS_DRAWN, clips=PLOT_AREAS)
    assert result.console_errors == [] and result.exceptions == [], (result.console_errors, result.exceptions)
    # the only request is the page itself (plots may use data: or blob: URLs, never the network)
    assert [u for u in result.requests if not u.startswith(("data:", "blob:"))] == [report_html.resolve().as_uri()]
    assert result.failed == []
    (tmp_path / "report.png").write_bytes(result.screenshot)
    assert result.screenshot[:8] == b"\x89PNG\r\n\x1a\n" and len(result.screenshot) > 50_000
    plots = result.value["plots"]
    # every fix is read whole: it wraps inside its box, never scrolls out of sight
    fixes = result.value["fixes"]
    assert fixes and all(scroll <= client for scroll, client in fixes), fixes
    assert len(plots) == 5 and all(p["svg"] >= 2 and p["traces"] > 0 for p in plots), plots
    titles = " | ".join(p["title"] for p in plots)
    assert "Step time per rank" in titles and "median step" in titles and "worst step" in titles
    # every plot area has drawn, coloured pixels (traces, bars, heatmap cells), not just a grid
    assert len(result.clips) == 5
    fractions = [coloured_fraction(png) for png in result.clips]
    assert all(f > 0.005 for f in fractions), fractions


@needs_chromium
def test_the_compare_page_loads_offline(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "compare.html"
    assert main(["compare", str(runs["base"]), str(runs["fixed"]), "--format", "html", "-o", str(out)]) == 0
    page = out.read_text()
    assert "resolved" in page and "constant-buffers" in page and "buffer_sync" in page
    result = open_page(out, PROBE, settle=PLOTS_DRAWN, clips=PLOT_AREAS)
    assert result.console_errors == [] and result.exceptions == []
    assert [u for u in result.requests if not u.startswith(("data:", "blob:"))] == [out.resolve().as_uri()]
    plots = result.value["plots"]
    assert len(plots) == 2 and all(p["svg"] >= 2 and p["traces"] > 0 for p in plots)
    assert all(coloured_fraction(png) > 0.005 for png in result.clips)
