"""The ``ddpdoctor watch`` application: a run dir (live or finished) or a stream, every panel at once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.widgets import DataTable, Footer

from ddpdoctor.analysis.live_run import HISTORY
from ddpdoctor.analysis.live_view import LiveSnapshot
from ddpdoctor.runlog.source import DirSource, RecordSource
from ddpdoctor_tui.bucket_heatmap import BucketHeatmap
from ddpdoctor_tui.findings_panel import FindingsPanel
from ddpdoctor_tui.help_screen import HelpScreen
from ddpdoctor_tui.rank_detail import RankDetail
from ddpdoctor_tui.ranks_table import RanksTable
from ddpdoctor_tui.run_header import RunHeader
from ddpdoctor_tui.step_chart import StepChart
from ddpdoctor_tui.watcher import SnapshotReady, SourceError, Watcher


class WatchApp(App[None]):
    """Live view of one run. ``source`` is a run dir (tailed; a finished run is replayed) or any
    :class:`~ddpdoctor.runlog.source.RecordSource` (a TCP stream): the app cannot tell them apart."""

    CSS_PATH = "watch_app.tcss"
    TITLE = "ddpdoctor watch"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("p,space", "pause", "Pause"),
        # priority: the ranks table (focused) would take these keys for its own cursor and scrolling
        Binding("left,comma", "step(-1)", "Step back", priority=True),
        Binding("right,full_stop", "step(1)", "Step fwd", priority=True),
        Binding("end", "follow", "Latest", priority=True),
        Binding("f", "filter_findings", "Filter findings"),
        Binding("question_mark", "help", "Help"),
    ]

    def __init__(
        self,
        source: RecordSource | str | os.PathLike[str] | None = None,
        *,
        interval: float = 0.2,
        history: int = HISTORY,
        ddp: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(source, (str, os.PathLike)):
            source = DirSource(Path(source), max_bytes_per_poll=1 << 20)
        self.source: RecordSource | None = source
        self.interval = interval
        self.history = history
        self.ddp = ddp  # the DDP model followed, where each process wrapped several
        self.snapshot: LiveSnapshot | None = None  # what the screen shows now
        self.paused = False
        self.view_step: int | None = None  # the step asked for (None: follow); snapshots catch up
        self.error: str | None = None
        self._watcher: Watcher | None = None

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        yield RanksTable(id="ranks")
        with Horizontal(id="middle"):
            yield BucketHeatmap(id="heatmap")
            yield RankDetail(id="detail")
        yield StepChart(id="chart")
        yield FindingsPanel(id="findings")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(BucketHeatmap).border_title = "bucket arrivals"
        self.query_one("#ranks").border_title = "ranks"
        self.query_one("#detail").border_title = "rank detail"
        self.query_one("#chart").border_title = "step time"
        self.query_one(FindingsPanel).border_title = "findings"
        self.query_one(RunHeader).update("waiting for records..." if self.source else "nothing to watch")
        if self.source is not None:
            self._watcher = Watcher(self.source, self, interval=self.interval, history=self.history, ddp=self.ddp)
            self._watcher.start()

    def on_unmount(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher.join(timeout=5)

    # -- updates from the watcher -------------------------------------------------------------

    @on(SnapshotReady)
    def _show(self, message: SnapshotReady) -> None:
        self.snapshot = snap = message.snapshot
        if self.paused and self.view_step is None and snap.view_step is not None:
            self._set_view(snap.view_step)  # paused before any step was complete: hold the first one
        self.query_one(RunHeader).show(snap, self.paused)
        table = self.query_one(RanksTable)
        table.show(snap)
        selected = table.selected_rank()
        self.query_one(BucketHeatmap).show(snap, selected)
        self.query_one(StepChart).show(snap)
        self.query_one(FindingsPanel).show(snap.findings)
        self.query_one(RankDetail).show(snap, selected)

    @on(SourceError)
    def _source_error(self, message: SourceError) -> None:
        self.error = message.error
        self.notify(message.error, title="source", severity="error", timeout=10)

    @on(DataTable.RowHighlighted)
    def _rank_selected(self, message: DataTable.RowHighlighted) -> None:
        if self.snapshot is not None:
            rank = self.query_one(RanksTable).selected_rank()
            self.query_one(RankDetail).show(self.snapshot, rank)
            self.query_one(BucketHeatmap).show(self.snapshot, rank)

    # -- actions --------------------------------------------------------------------------------

    def _set_view(self, step: int | None) -> None:
        self.paused = step is not None
        self.view_step = step
        if self._watcher is not None:
            self._watcher.view_step = step
            self._watcher.wake()
        if self.snapshot is not None:
            self.query_one(RunHeader).show(self.snapshot, self.paused)

    def action_pause(self) -> None:
        """Hold the view on the step shown now; again: follow the latest step."""
        if self.paused:
            self._set_view(None)
        elif self.snapshot is not None and self.snapshot.view_step is not None:
            self._set_view(self.snapshot.view_step)
        else:
            self.paused = True  # nothing to hold yet: the first complete step will be held

    def action_step(self, delta: int) -> None:
        """Move the view ``delta`` complete steps in time (pauses following)."""
        snap = self.snapshot
        if snap is None or not snap.steps or snap.view_step is None:
            return
        steps = snap.steps
        current = self.view_step if self.view_step is not None else snap.view_step  # keys outrun snapshots
        try:
            i = steps.index(current)
        except ValueError:
            i = len(steps) - 1
        self._set_view(steps[max(0, min(len(steps) - 1, i + delta))])

    def action_follow(self) -> None:
        self._set_view(None)

    def action_filter_findings(self) -> None:
        floor = self.query_one(FindingsPanel).cycle_filter()
        self.notify(f"findings: {floor} and worse", timeout=2)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())
