"""The ``ddpdoctor watch`` application: a run dir (live or finished) or a stream, every panel at once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, NamedTuple

from textual import on
from textual.actions import SkipAction
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.widgets import DataTable, Footer, Input

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


class _Panels(NamedTuple):
    """The main screen's widgets that show a snapshot."""

    header: RunHeader
    table: RanksTable
    heatmap: BucketHeatmap
    chart: StepChart
    findings: FindingsPanel
    detail: RankDetail


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
        # at hundreds of ranks: sort, filter by rank or host, roll up per host, back to the worst
        Binding("s", "cycle_sort", "Sort", show=False),
        Binding("slash", "rank_filter", "Filter ranks", show=False),
        Binding("n", "toggle_nodes", "Per host", show=False),
        Binding("w", "follow_worst", "Worst rank", show=False),
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
        yield Input(placeholder="ranks (3, 96-103) or host names; enter: apply, escape: close", id="rank-filter")
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

    def _panels(self) -> _Panels | None:
        """The widgets a snapshot is drawn on; None once any is gone (the app is closing: its
        screen is taken down widget by widget while the watcher may still post) or covered."""
        try:
            return _Panels(
                self.query_one(RunHeader),
                self.query_one(RanksTable),
                self.query_one(BucketHeatmap),
                self.query_one(StepChart),
                self.query_one(FindingsPanel),
                self.query_one(RankDetail),
            )
        except NoMatches:
            return None

    @on(SnapshotReady)
    def _show(self, message: SnapshotReady) -> None:
        panels = self._panels()
        if panels is None:
            return
        self.snapshot = snap = message.snapshot
        if self.paused and self.view_step is None and snap.view_step is not None:
            self._set_view(snap.view_step)  # paused before any step was complete: hold the first one
        table = panels.table
        table.show(snap)
        panels.header.show(snap, self.paused, table.judged)  # (the table judged the ranks)
        selected = table.detail_rank()
        panels.heatmap.show(snap, selected, at_scale=table.at_scale)
        panels.chart.show(snap)
        panels.findings.show(snap.findings)
        panels.detail.show(snap, selected)

    @on(SourceError)
    def _source_error(self, message: SourceError) -> None:
        self.error = message.error
        self.notify(message.error, title="source", severity="error", timeout=10)

    @on(DataTable.RowHighlighted)
    def _rank_selected(self, message: DataTable.RowHighlighted) -> None:
        self._show_detail()

    def _show_detail(self) -> None:
        panels = self._panels()  # (none once the app is closing: a late highlight)
        if self.snapshot is not None and panels is not None:
            rank = panels.table.detail_rank()
            panels.detail.show(self.snapshot, rank)
            panels.heatmap.show(self.snapshot, rank, at_scale=panels.table.at_scale)

    def _reshow_ranks(self) -> None:
        """Lay the ranks table out again now (a sort, a filter, the roll-up), not at the next tick."""
        panels = self._panels()
        if self.snapshot is not None and panels is not None:
            panels.table.show(self.snapshot)
            self._show_detail()

    @on(DataTable.HeaderSelected)
    def _sort_by_header(self, message: DataTable.HeaderSelected) -> None:
        self.query_one(RanksTable).sort_by(str(message.column_key.value))
        self._reshow_ranks()

    @on(Input.Changed, "#rank-filter")
    def _filter_changed(self, message: Input.Changed) -> None:
        self.query_one(RanksTable).filter_text = message.value
        self._reshow_ranks()

    @on(Input.Submitted, "#rank-filter")
    def _filter_done(self, message: Input.Submitted) -> None:
        self._close_filter()

    def _close_filter(self) -> None:
        box = self.query_one("#rank-filter", Input)
        box.display = False
        self.query_one(RanksTable).focus()

    # -- actions --------------------------------------------------------------------------------

    def _set_view(self, step: int | None) -> None:
        self.paused = step is not None
        self.view_step = step
        if self._watcher is not None:
            self._watcher.view_step = step
            self._watcher.wake()
        panels = self._panels()
        if self.snapshot is not None and panels is not None:
            panels.header.show(self.snapshot, self.paused, panels.table.judged)

    def action_pause(self) -> None:
        """Hold the view on the step shown now; again: follow the latest step."""
        if self.paused:
            self._set_view(None)
        elif self.snapshot is not None and self.snapshot.view_step is not None:
            self._set_view(self.snapshot.view_step)
        else:
            self.paused = True  # nothing to hold yet: the first complete step will be held

    def _typing(self) -> None:
        """Leave the key to the filter box while it has focus: its ``,`` and ``.`` (``0,3``,
        ``node1.cluster``), its cursor keys. (The step keys are priority bindings, so that the
        ranks table does not take them: without this they would reach no text box either.)"""
        if isinstance(self.focused, Input):
            raise SkipAction()

    def action_step(self, delta: int) -> None:
        """Move the view ``delta`` complete steps in time (pauses following)."""
        self._typing()
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
        self._typing()
        self._set_view(None)

    def action_filter_findings(self) -> None:
        floor = self.query_one(FindingsPanel).cycle_filter()
        self.notify(f"findings: {floor} and worse", timeout=2)

    def action_cycle_sort(self) -> None:
        """Sort the ranks table by the next column (cost to others, lateness, step time, ...)."""
        label = self.query_one(RanksTable).cycle_sort()
        self._reshow_ranks()
        self.notify(f"ranks: sorted by {label}", timeout=2)

    def action_rank_filter(self) -> None:
        """Open the filter by rank or host under the ranks table (escape or enter closes it)."""
        box = self.query_one("#rank-filter", Input)
        box.display = True
        box.focus()

    def action_toggle_nodes(self) -> None:
        """One row per host (the medians of its ranks), or one per rank again."""
        table = self.query_one(RanksTable)
        table.by_node = not table.by_node
        self._reshow_ranks()

    def action_follow_worst(self) -> None:
        """The rank detail follows the worst rank again (after a rank was picked)."""
        self.query_one(RanksTable).follow_worst()
        self._show_detail()

    def key_escape(self) -> None:
        if self.query_one("#rank-filter", Input).display:
            self._close_filter()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())
