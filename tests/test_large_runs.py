"""Every view at hundreds and thousands of ranks leads with the ranks that matter.

Synthetic runs of 256 and 2,048 ranks (``bench/synth.py``, written by the ranks' own writer) with
a straggler rank (backward 30 ms slower), a slow node (its 8 ranks' forward 15 ms slower) and a
dead rank (its log stops without an end record): the text report names all three in its first
30 lines and stays under 100 lines; Markdown and HTML lead with them; the live view's first screen
(Pilot, and a real terminal under tmux) shows the straggler's row on top.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from textual.widgets import Input

from bench.synth_run import write_run
from ddpdoctor.analysis import Report, analyze
from ddpdoctor.analysis.blame import NOISE_FLOOR_MS, by_host, fold_into_hosts, out_of_line, spread_floor_ms
from ddpdoctor.analysis.live_view import hosts_text
from ddpdoctor.cli.main import main
from ddpdoctor.cli.render_text import render, render_markdown
from ddpdoctor.runlog import load_run
from ddpdoctor_tui import WatchApp
from ddpdoctor_tui.bucket_heatmap import BucketHeatmap
from ddpdoctor_tui.rank_detail import RankDetail
from ddpdoctor_tui.ranks_table import RanksTable
from ddpdoctor_tui.run_header import RunHeader
from tests.test_tui_terminal import ROOT, Terminal
from tests.test_tui_watch import SIZE, screen_text, wait_for, widget_text


@dataclass(frozen=True)
class Planted:
    ranks: int
    steps: int
    straggler: int
    slow_node: int
    dead: int

    @property
    def hosts(self) -> int:
        return self.ranks // 8

    @property
    def slow_host(self) -> str:
        return f"node{self.slow_node:03d}"


RUNS = {
    256: Planted(ranks=256, steps=60, straggler=77, slow_node=12, dead=200),
    2048: Planted(ranks=2048, steps=40, straggler=1234, slow_node=100, dead=1900),
}


@pytest.fixture(scope="module", params=sorted(RUNS), ids=lambda n: f"{n}-ranks")
def large(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Planted, Report]:
    p = RUNS[request.param]
    out = tmp_path_factory.mktemp(f"synth{p.ranks}")
    write_run(out, p.ranks, p.steps, 8, p.straggler, 2, "compact", None, p.slow_node, p.dead)
    return out, p, analyze(load_run(out, max_steps="auto"))


@pytest.fixture(scope="module")
def run256(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Planted]:
    p = RUNS[256]
    out = tmp_path_factory.mktemp("synth256")
    write_run(out, p.ranks, p.steps, 8, p.straggler, 2, "compact", None, p.slow_node, p.dead)
    return out, p


def _names_all_three(lines: list[str], p: Planted) -> None:
    head = "\n".join(lines)
    assert re.search(rf"rank {p.straggler} \(node\d+\): cost the others .*backward \+", head), head
    assert re.search(rf"host {p.slow_host} \(ranks {p.slow_node * 8}-{p.slow_node * 8 + 7}\): .*forward \+", head), head
    assert re.search(rf"rank {p.dead} \(node\d+\): lost; logged \d+ of {p.steps} steps", head), head


# -- the report ---------------------------------------------------------------------------------


def test_the_text_report_names_the_three_in_its_first_30_lines(large: tuple[Path, Planted, Report]) -> None:
    _, p, report = large
    lines = render(report).splitlines()
    assert len(lines) <= 100, len(lines)
    _names_all_three(lines[:30], p)
    # the findings first, then what is out of line, the rest in a line, the hosts in a line
    assert lines.index(next(x for x in lines if x.startswith("Findings ("))) < lines.index(
        next(x for x in lines if x.startswith("Out of line, worst first: 2 of"))
    )
    assert f"{p.hosts} hosts: node000–node{p.hosts - 1:03d}" in lines[1]
    within = next(x for x in lines if "ranks within noise" in x)
    # every rank but the straggler, the dead one and the slow node's eight
    assert within.strip().startswith(f"{p.ranks - 10} ranks within noise: step ")
    assert "backward 50." in within and "forward 24." in within
    hosts = next(x for x in lines if x.strip().startswith(f"{p.hosts} hosts, 8 ranks each"))
    assert f"{p.slow_host} out of line" in hosts and f"{p.hosts - 1} hosts within noise" in hosts
    # no line lists every rank: a finding's long list of ranks is in ranges
    assert max(len(x) for x in lines) < 600
    # the slow node's ranks are one line, not eight rows
    assert not any(re.match(rf"\s+rank {p.slow_node * 8} ", x) for x in lines)


def test_all_ranks_and_json_have_every_rank(large: tuple[Path, Planted, Report]) -> None:
    _, p, report = large
    lines = render(report, all_ranks=True).splitlines()
    table = lines[lines.index("Per-rank medians (ms):") + 1 :]
    rows = [x for x in table if re.match(r"\s+\d+\s+node\d+", x)]
    assert len(rows) == p.ranks
    data = json.loads(json.dumps(report.to_dict()))
    assert len(data["ranks"]) == p.ranks
    view = data["stats"]["out_of_line"]
    listed = [o["rank"] for o in view["ranks"] if not o["in_host"]]
    assert listed == [p.dead, p.straggler]  # worst first: dead, then what it cost the others
    assert sorted(o["rank"] for o in view["ranks"] if o["in_host"]) == list(range(p.slow_node * 8, p.slow_node * 8 + 8))
    assert [h["host"] for h in view["hosts"]] == [p.slow_host]
    assert view["within_noise"][0]["count"] == p.ranks - 10


def test_markdown_and_html_lead_with_the_same(
    run256: tuple[Path, Planted], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, p = run256
    report = analyze(load_run(run_dir, max_steps="auto"))
    md = render_markdown(report).splitlines()
    section = md[md.index("## Out of line (worst first)") :]
    _names_all_three(section[:8], p)
    assert md.index("## Findings") < md.index("## Out of line (worst first)")
    assert len(md) < 100 and "`--all-ranks`" in md[-1]
    page = tmp_path / "report.html"
    assert main(["report", str(run_dir), "--format", "html", "-o", str(page)]) == 0
    html = page.read_text()
    first = html.index("<h2>Out of line")
    full = html.index("<details><summary>Per-rank medians (ms) of every rank (256)")
    assert html.index("<h2>Findings") < first < full
    assert f"rank {p.straggler} (node009): cost the others" in html[first:full]
    assert f"host {p.slow_host} (ranks 96-103)" in html[first:full]
    assert html[full:].split("</details>")[0].count("<tr>") == p.ranks + 1
    assert main(["report", str(run_dir), "--all-ranks"]) == 0
    assert len(capsys.readouterr().out.splitlines()) > p.ranks


def test_compare_lists_the_ranks_that_moved_most_first(
    run256: tuple[Path, Planted], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, p = run256
    base = tmp_path / "base"
    write_run(base, p.ranks, p.steps, 8, None, 2, "compact")
    assert main(["compare", str(base), str(run_dir)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text.index("Findings") < text.index(next(x for x in text if x.startswith("Phases")))
    ranks = text[text.index(next(x for x in text if x.startswith("Ranks (medians; the 16 of 256"))) + 1 :]
    moved = [
        max(abs(float(r[2]) - float(r[1])), abs(float(r[4]) - float(r[3]))) for r in (x.split() for x in ranks[1:17])
    ]
    assert moved == sorted(moved, reverse=True)  # most first
    assert "--all-ranks" in ranks[17]
    assert main(["compare", str(base), str(run_dir), "--all-ranks"]) == 0
    assert len(capsys.readouterr().out.splitlines()) > p.ranks


# -- the one judgement ---------------------------------------------------------------------------


def test_out_of_line_against_the_others_spread() -> None:
    values = {r: {"step": 100.0, "backward": 50.0 + 0.1 * (r % 3), "late": 1.0} for r in range(64)}
    values[5] = {**values[5], "backward": 65.0, "late": 15.0}  # +15 ms: over the floor (10% of the step)
    values[6] = {**values[6], "backward": 58.0}  # +8 ms: under it, noise
    out = out_of_line(values, cost_ms={5: 900.0}, named={5}, statuses={9: "lost"}, steps={r: 100 for r in range(64)})
    assert [o.key for o in out] == [9, 5]  # a lost rank first, then the costly one
    assert out[1].named and set(out[1].excess_ms) == {"backward", "late"}
    assert out[1].reasons()[0] == "cost the others 900 ms" and out[0].reasons() == ["lost"]
    assert spread_floor_ms([100.0] * 10, 100.0) == 10.0 and spread_floor_ms([1.0] * 10, 1.0) == NOISE_FLOOR_MS
    # a run that jitters widely raises the floor: a rank at its edge is not out of line
    wide = {r: {"step": 100.0, "forward": 20.0 + (r % 10) * 4.0} for r in range(50)}
    wide[0] = {"step": 100.0, "forward": 70.0}
    assert out_of_line(wide) == []
    # two ranks: each judged against the other
    two = out_of_line({0: {"step": 100.0, "late": 0.5}, 1: {"step": 100.0, "late": 30.0}})
    assert [o.key for o in two] == [1] and two[0].base_ms["late"] == 0.5
    # a rank that stopped early, without a status that says why
    early = out_of_line({r: {"step": 100.0} for r in range(4)}, steps={0: 50, 1: 100, 2: 100, 3: 100})
    assert [o.key for o in early] == [0] and early[0].reasons() == ["logged 50 of 100 steps"]


def test_a_slow_node_is_one_host_out_of_line() -> None:
    values = {r: {"step": 100.0, "forward": 20.0 + (15.0 if r // 8 == 3 else 0.0)} for r in range(64)}
    values[40] = {"step": 100.0, "forward": 60.0}  # one slow rank on a host of its own
    hosts = {r: f"n{r // 8}" for r in range(64)}
    ranks = out_of_line(values)
    on_hosts = out_of_line(by_host(values, hosts))
    assert [o.key for o in on_hosts] == ["n3"]  # a single slow rank does not move its host's median
    assert [o.key for o in fold_into_hosts(ranks, on_hosts, hosts)] == [40]


def test_hosts_in_a_few_words() -> None:
    assert hosts_text(["b", "a"]) == "a, b"
    assert hosts_text([f"node{i:03d}" for i in range(32)]) == "32 hosts: node000–node031"
    gappy = [f"gpu{i}" for i in (1, 2, 3, 7, 8)] + ["login"]
    assert hosts_text(gappy) == "6 hosts: gpu1–gpu3, gpu7, gpu8, login"
    many = [f"n{i:02d}" for i in range(0, 40, 2)]
    assert hosts_text(many).startswith("20 hosts: n00, n02") and "(14 more ranges)" in hosts_text(many)


# -- the live view -------------------------------------------------------------------------------


@pytest.mark.slow  # (2,048 ranks: two minutes on a loaded machine)
async def test_the_tui_first_screen_leads_with_the_straggler(large: tuple[Path, Planted, Report]) -> None:
    run_dir, p, _ = large
    app = WatchApp(run_dir, interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(
            pilot,
            lambda: (
                app.snapshot is not None
                and len(app.snapshot.ranks) == p.ranks
                and any(r.status == "lost" for r in app.snapshot.ranks)
                and app.query_one(RanksTable).worst == p.straggler
            ),
            timeout=120,
        )
        table = app.query_one(RanksTable)
        assert table.get_row_at(0)[0] == str(p.straggler)  # sorted by cost to others
        screen = screen_text(app)
        assert re.search(rf"│ {p.straggler}\s+node\d+\s+\d+", screen), screen
        header = widget_text(app.query_one(RunHeader))
        assert f"{p.hosts} hosts: node000–node{p.hosts - 1:03d}" in header
        assert (
            f"rank {p.straggler} (" in header and f"host {p.slow_host}" in header and f"rank {p.dead} (lost" in header
        )
        # the detail and the heatmap's first row follow the worst rank
        assert app.query_one(RankDetail).border_title == f"rank {p.straggler}"
        assert app.query_one(BucketHeatmap).text_lines()[1].split()[0] == str(p.straggler)
        # a rank picked with the keys holds the detail; w goes back to the worst
        await pilot.press("down")
        picked = table.selected_rank()
        assert picked != p.straggler and table.picked == picked
        await pilot.pause(0.3)  # the next snapshots do not move it back
        assert app.query_one(RankDetail).border_title == f"rank {picked}"
        await pilot.press("w")
        assert app.query_one(RankDetail).border_title == f"rank {p.straggler}" and table.selected_rank() == p.straggler
        # filter by host, then by a range of ranks
        await pilot.press("slash")
        box = app.query_one("#rank-filter", Input)
        assert box.display and box.has_focus
        await pilot.press(*p.slow_host, "enter")
        assert not box.display and table.row_count == 8
        assert {table.get_row_at(i)[1] for i in range(8)} == {p.slow_host}
        await pilot.press("slash", *["backspace"] * len(p.slow_host), *f"{p.dead}-{p.dead + 2}", "enter")
        assert sorted(int(table.get_row_at(i)[0]) for i in range(table.row_count)) == [p.dead, p.dead + 1, p.dead + 2]
        await pilot.press("slash", *["backspace"] * 20, "enter")
        assert table.row_count == p.ranks
        # one row per host: the straggler's host costs the others most
        await pilot.press("n")
        assert table.row_count == p.hosts and table.get_row_at(0)[1] == f"node{p.straggler // 8:03d}"
        await pilot.press("n")
        # sort by lateness at the viewed step, then by rank (a header click does the same)
        await pilot.press("s")
        assert table.effective_sort() == "late"
        table.sort_by("rank")
        app._reshow_ranks()
        assert [table.get_row_at(i)[0] for i in range(3)] == ["0", "1", "2"]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_the_straggler_row_on_the_first_screen_of_a_real_terminal(run256: tuple[Path, Planted]) -> None:
    run_dir, p = run256
    # this tree's live view (the ``ddpdoctor_tui`` package lives under tui/), not an installed one
    path = f"{ROOT}:{ROOT / 'tui'}"
    term = Terminal(
        f"PYTHONPATH={shlex.quote(path)} {shlex.quote(sys.executable)} -m ddpdoctor watch {shlex.quote(str(run_dir))}"
    )
    try:
        screen = term.wait_until(
            lambda s: re.search(rf"│ {p.straggler}\s+node009\s+\d+", s) is not None and "lost" in s,
            "the straggler's row",
            timeout=120,
        )
        rows = [x for x in screen.splitlines() if re.match(r"│ \d+\s+node\d+", x)]
        assert rows[0].split()[1] == str(p.straggler), screen
        assert "32 hosts: node000–node031" in screen and f"host {p.slow_host}" in screen
        term.keys("q")
        term.wait_for("EXITED rc=0")
    finally:
        term.close()
