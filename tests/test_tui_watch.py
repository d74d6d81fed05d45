"""``ddpdoctor watch`` under Textual's Pilot at a fixed size: every panel and every key binding."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text
from textual.app import App
from textual.pilot import Pilot
from textual.widgets import Input, Sparkline, Static

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.events import Record, encode
from ddpdoctor.events.layout import rank_file_name
from ddpdoctor.runlog import DirSource
from ddpdoctor_tui import WatchApp
from ddpdoctor_tui.bucket_heatmap import BucketHeatmap
from ddpdoctor_tui.findings_panel import FindingsPanel
from ddpdoctor_tui.help_screen import HelpScreen
from ddpdoctor_tui.rank_detail import RankDetail
from ddpdoctor_tui.ranks_table import RanksTable
from ddpdoctor_tui.run_header import RunHeader
from ddpdoctor_tui.watcher import SnapshotReady
from tests.test_live_run import synthetic_records, write_run

SIZE = (120, 40)


def screen_text(app: App[Any]) -> str:
    """What the terminal shows, as plain text."""
    width, height = app.size
    console = Console(
        width=width,
        height=height,
        file=io.StringIO(),
        record=True,
        force_terminal=True,
        color_system="truecolor",
        legacy_windows=False,
    )
    console.print(app.screen._compositor.render_update(full=True))
    return console.export_text()


def widget_text(widget: Static) -> str:
    """The plain text of what a Static holds."""
    content = widget.content
    if isinstance(content, str):
        return content
    console = Console(width=200, file=io.StringIO(), record=True)
    console.print(content)
    return console.export_text()


async def wait_for(pilot: Pilot[Any], condition: Callable[[], bool], timeout: float = 15.0) -> None:
    """Let the app run until ``condition`` holds (the watcher thread delivers asynchronously)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await pilot.pause(0.02)
    await pilot.pause()


def cell(table: RanksTable, row: str, column: str) -> Text:
    """A ranks-table cell as rich Text (plain strings too)."""
    value = table.get_cell(row, column)
    return value if isinstance(value, Text) else Text(str(value))


def at_step(app: WatchApp, step: int) -> Callable[[], bool]:
    return lambda: app.snapshot is not None and app.snapshot.view_step == step


async def test_panels_show_a_straggler_run(tmp_path: Path) -> None:
    app = WatchApp(write_run(tmp_path / "run", world=4, steps=30, straggler=2, end=None), interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, at_step(app, 29))
        header = widget_text(app.query_one(RunHeader))
        assert "synthetic" in header and "ranks 4/4" in header and "gloo/cpu" in header and "WARNING" in header
        assert "step 29" in header and "[live]" in header
        table = app.query_one(RanksTable)
        assert table.row_count == 4
        status = cell(table, "2", "status")
        assert status.plain.strip() == "straggler" and "dark_orange" in str(status.style)
        assert cell(table, "0", "status").plain.strip() == "running"
        assert cell(table, "2", "late").plain == "40.0" and cell(table, "0", "wait").plain == "40.0"
        heatmap = app.query_one(BucketHeatmap)
        assert heatmap.border_subtitle == "latest: rank 2 at b0, +40.0 ms"
        lines = heatmap.text_lines()
        assert lines[0].split() == ["rank", "b0", "b1", "b2", "b3"] and lines[3].split() == [
            "2",
            "40",
            "40",
            "40",
            "40",
        ]
        assert lines[1].split() == ["0", ".", ".", ".", "."]
        assert "latest: rank 2 at b0" in screen_text(app)
        assert len(app.query_one("#chart-max", Sparkline).data or []) == 30
        findings = widget_text(app.query_one("#findings-text", Static))
        assert "straggler" in findings and "fix:" in findings
        detail = widget_text(app.query_one("#detail-text", Static))
        assert "rank 0" in detail and "ready ms" in detail


async def test_select_rank_moves_the_detail_and_the_heatmap_marker(tmp_path: Path) -> None:
    app = WatchApp(write_run(tmp_path / "run", world=4, steps=20, straggler=2), interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, at_step(app, 19))
        await pilot.press("down", "down")
        assert app.query_one(RanksTable).selected_rank() == 2
        detail = widget_text(app.query_one("#detail-text", Static))
        assert detail.startswith("rank 2") and "40.0" in detail
        assert app.query_one(RankDetail).border_title == "rank 2"
        await pilot.press("up")
        assert widget_text(app.query_one("#detail-text", Static)).startswith("rank 1")


async def test_pause_step_back_forward_and_follow(tmp_path: Path) -> None:
    app = WatchApp(write_run(tmp_path / "run", world=2, steps=25), interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, at_step(app, 24))
        await pilot.press("p")
        assert app.paused and "PAUSED" in widget_text(app.query_one(RunHeader))
        await pilot.press("left", "left", "comma")
        await wait_for(pilot, at_step(app, 21))
        assert app.snapshot is not None and {r.step for r in app.snapshot.ranks} == {21}
        assert "step 21" in widget_text(app.query_one(RunHeader))
        await pilot.press("right")
        await wait_for(pilot, at_step(app, 22))
        await pilot.press("full_stop", "right", "right", "right")  # past the end: stays on the last step
        await wait_for(pilot, at_step(app, 24))
        assert app.paused
        await pilot.press("end")
        assert not app.paused
        await pilot.press("left")
        await wait_for(pilot, at_step(app, 23))
        await pilot.press("space")  # pause again resumes following
        await wait_for(pilot, lambda: not app.paused and app.snapshot is not None and app.snapshot.view_step == 24)


async def test_filter_findings_by_severity(tmp_path: Path) -> None:
    app = WatchApp(write_run(tmp_path / "run", world=4, steps=20, straggler=1, end=None), interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, at_step(app, 19))
        panel = app.query_one(FindingsPanel)
        assert "straggler" in widget_text(app.query_one("#findings-text", Static))
        await pilot.press("f")
        assert panel.min_severity == "warning" and "straggler" in widget_text(app.query_one("#findings-text", Static))
        await pilot.press("f")
        assert panel.min_severity == "error"
        assert "no findings at this severity" in widget_text(app.query_one("#findings-text", Static))
        assert "1 hidden" in str(panel.border_title)
        await pilot.press("f")
        assert panel.min_severity == "info"


async def test_hung_ranks_show_their_stack(tmp_path: Path) -> None:
    app = WatchApp(write_run(tmp_path / "run", world=3, steps=20, hang_at=12), interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.health == "error")
        table = app.query_one(RanksTable)
        assert [cell(table, str(r), "status").plain.strip() for r in range(3)] == ["hung"] * 3
        assert "ERROR" in widget_text(app.query_one(RunHeader))
        await pilot.press("down", "down")
        detail = widget_text(app.query_one("#detail-text", Static))
        assert "no progress for 30 s in between steps of step 12" in detail
        assert "train.py:12 in evaluate" in detail
        assert "hang" in widget_text(app.query_one("#findings-text", Static))


async def test_help_opens_and_closes_and_q_quits(tmp_path: Path) -> None:
    app = WatchApp(write_run(tmp_path / "run", world=2, steps=5), interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "step back" in screen_text(app) and "straggler" in screen_text(app)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
    assert app.return_code == 0


async def test_tails_a_growing_run_through_garbage_truncation_and_late_ranks(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    recs = {r: synthetic_records(r, 3, range(40), end=None) for r in range(3)}

    def append(rank: int, records: Sequence[Record], junk: bytes = b"") -> None:
        with open(d / rank_file_name(rank), "ab") as f:
            f.writelines(encode(rec) + junk for rec in records)

    app = WatchApp(d, interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        assert "waiting" in widget_text(app.query_one(RunHeader))
        append(0, recs[0][:10], b"{garbage\n")
        append(1, recs[1][:10])
        await wait_for(pilot, lambda: app.snapshot is not None and len(app.snapshot.ranks) == 2)
        assert "waiting for steps from every rank" in widget_text(app.query_one(RunHeader))
        assert "corrupt" in widget_text(app.query_one(RunHeader))
        append(2, recs[2][:10])  # the late rank
        await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.view_step is not None)
        for r in range(3):
            append(r, recs[r][10:30])
        await wait_for(pilot, lambda: app.snapshot is not None and (app.snapshot.view_step or 0) >= 20)
        (d / "rank-00001.jsonl").write_bytes(encode(recs[1][0]))  # truncated and rewritten
        (d / "rank-00002.jsonl").unlink()
        await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.ranks[1].step is None)
        assert app.query_one(RanksTable).row_count == 3
        await pilot.press("q")
    assert app.return_code == 0


async def test_a_streamed_run_looks_the_same(tmp_path: Path) -> None:
    from ddpdoctor.sinks.tcp import TcpSink
    from ddpdoctor.stream.source import StreamSource

    source = StreamSource("127.0.0.1", 0)
    app = WatchApp(source, interval=0.05)
    sinks = [TcpSink(f"127.0.0.1:{source.port}", rank=r, run="synthetic") for r in range(3)]
    try:
        async with app.run_test(size=SIZE) as pilot:
            assert "listening on 127.0.0.1" in widget_text(app.query_one(RunHeader))
            for r, sink in enumerate(sinks):
                for rec in synthetic_records(r, 3, range(20), straggler=1):
                    sink.emit(rec)
                sink.flush()
            await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.finished)
            assert app.snapshot is not None and app.snapshot.view_step == 19
            assert cell(app.query_one(RanksTable), "1", "late").plain == "40.0"
            assert "straggler" in widget_text(app.query_one("#findings-text", Static))
    finally:
        for sink in sinks:
            sink.close()


async def test_an_elastic_restart_moves_the_view_to_the_new_attempt(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_run(run / "attempt-0", world=2, steps=12, straggler=1, end=None)  # killed mid-run
    app = WatchApp(run, interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, at_step(app, 11))
        assert app.snapshot is not None and [f.code for f in app.snapshot.findings] == ["straggler"]
        assert "attempt" not in widget_text(app.query_one(RunHeader)).split("\n")[0]
        write_run(run / "attempt-1", world=2, steps=5)  # torchrun restarted every worker
        await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.attempt == 1)
        await wait_for(pilot, at_step(app, 4))
        header = widget_text(app.query_one(RunHeader))
        assert "attempt 1 (restarted)" in header and "attempt-1" in header and "FINISHED" in header
        assert app.query_one(RanksTable).row_count == 2  # the new attempt's ranks, not old and new
        assert not app.snapshot.findings  # attempt 0's straggler belongs to attempt 0
        await pilot.press("q")
    assert app.return_code == 0


async def test_a_column_widens_when_longer_values_come_after_the_first_rows(tmp_path: Path) -> None:
    """At first a rank has no step ("-" in every number column); the later "40.0" is not cut to "40."."""
    run = tmp_path / "run"
    run.mkdir()
    records = {r: synthetic_records(r, 2, range(3), end=None) for r in range(2)}
    for r in range(2):  # header and layout only: the rows appear before any step
        (run / rank_file_name(r)).write_bytes(b"".join(encode(x) for x in records[r][:2]))
    app = WatchApp(DirSource(run), interval=0.05)
    async with app.run_test(size=(160, 48)) as pilot:
        table = app.query_one(RanksTable)
        await wait_for(pilot, lambda: table.row_count == 2)
        for r in range(2):
            with open(run / rank_file_name(r), "ab") as f:
                f.write(b"".join(encode(x) for x in records[r][2:]))
        await wait_for(pilot, at_step(app, 2))
        row = next(line for line in screen_text(app).splitlines() if line.startswith("│ 0 "))
        # rank, host, step, step ms, fwd, bwd, ar wait, buf sync, late, cost to others
        assert row.split()[1:11] == ["0", "node0", "2", "100.0", "20.0", "40.0", "0.0", "-", "0.0", "0.0"]
        assert "cost to others" in screen_text(app)


async def test_a_snapshot_that_comes_after_the_screen_is_gone_is_dropped(tmp_path: Path) -> None:
    """Closing, the app takes its screen down widget by widget while the watcher may still post:
    a snapshot that finds the header gone is dropped, not half drawn (NoMatches before)."""
    app = WatchApp(write_run(tmp_path / "run", world=2, steps=5), interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, at_step(app, 4))
        shown = app.snapshot
        assert shown is not None
        await app.query_one(RunHeader).remove()
        app.post_message(SnapshotReady(shown))
        await pilot.pause()
        assert app.query_one(RanksTable).row_count == 2  # the rest of the screen is as it was
        await pilot.press("left")  # a step key while the header is gone: no NoMatches either
        await pilot.press("q")
    assert app.return_code == 0


async def test_a_finding_over_the_whole_run_shows_no_step(tmp_path: Path) -> None:
    """The bucket what-if judges the run, not a step: its line says no "step None"."""
    app = WatchApp(write_run(tmp_path / "run", world=2, steps=5), interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, at_step(app, 4))
        whatif = Finding(code="bucket-size", severity="info", title="fewer buckets", detail="", fix="bucket_cap_mb=50")
        app.query_one(FindingsPanel).show((whatif,))
        text = widget_text(app.query_one("#findings-text", Static))
        assert "bucket-size" in text and "None" not in text
        assert "        ranks -\n" in text
        await pilot.press("q")


async def test_the_rank_filter_takes_commas_and_dots(tmp_path: Path) -> None:
    """``,`` and ``.`` step the view everywhere else; in the filter box they are typed ("0,3",
    "node1.cluster"), and so are the cursor keys."""
    app = WatchApp(write_run(tmp_path / "run", world=4, steps=10), interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, at_step(app, 9))
        table = app.query_one(RanksTable)
        await pilot.press("slash", "0", "comma", "3")
        box = app.query_one("#rank-filter", Input)
        assert box.value == "0,3" and not app.paused
        await pilot.press("left", "left", "2", "end", "full_stop")
        assert box.value == "02,3." and not app.paused
        await pilot.press(*["backspace"] * 5, "0", "comma", "3", "enter")
        assert not box.display and sorted(int(table.get_row_at(i)[0]) for i in range(table.row_count)) == [0, 3]
        await pilot.press("comma")  # the table has focus again: the key steps the view back
        await wait_for(pilot, at_step(app, 8))
        assert app.paused
        await pilot.press("q")
    assert app.return_code == 0
