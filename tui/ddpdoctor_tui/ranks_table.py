"""The ranks table: one row per rank, its numbers at the viewed step and its status in colour."""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from ddpdoctor.analysis.live_view import LiveSnapshot, RankView
from ddpdoctor_tui.formatting import mib, ms, status_text

COLUMNS: tuple[tuple[str, str], ...] = (
    ("rank", "rank"),
    ("host", "host"),
    ("step", "step"),
    ("step_ms", "step ms"),
    ("fwd", "fwd"),
    ("bwd", "bwd"),
    ("wait", "ar wait"),
    ("bcast", "buf sync"),
    ("late", "late"),
    ("lost_for_others", "cost to others"),
    ("cpu", "cpu%"),
    ("rss", "rss"),
    ("status", "status"),
)


def _cells(r: RankView) -> tuple[object, ...]:
    late = Text(ms(r.late_ms), style="bold dark_orange" if (r.late_ms or 0.0) >= 10.0 else "")
    return (
        str(r.rank),
        r.host[:14],
        "-" if r.step is None else str(r.step),
        ms(r.step_ms),
        ms(r.fwd_ms),
        ms(r.bwd_ms),
        ms(r.wait_ms),
        ms(r.bcast_ms, 2),
        late,
        ms(r.lost_for_others_ms),
        "-" if r.cpu_pct is None else f"{r.cpu_pct:.0f}",
        mib(r.rss_bytes),
        status_text(r.status),
    )


def _width(cell: object) -> int:
    return cell.cell_len if isinstance(cell, Text) else len(str(cell))


class RanksTable(DataTable[object]):
    """Rows keyed by rank: updated cell by cell so the cursor (the selected rank) stays put."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        for key, label in COLUMNS:
            self.add_column(label, key=key)
        self._shown: dict[int, tuple[object, ...]] = {}

    def show(self, snap: LiveSnapshot) -> None:
        """Bring the rows up to ``snap`` (new ranks are appended in rank order as they appear)."""
        for r in snap.ranks:
            cells = _cells(r)
            old = self._shown.get(r.rank)
            if old is None:
                self._fit(zip((key for key, _ in COLUMNS), cells, strict=True))
                self.add_row(*cells, key=str(r.rank))
            elif old != cells:
                for (key, _), new, was in zip(COLUMNS, cells, old, strict=True):
                    if new != was:
                        # a column is as wide as its first rows were ("-" before the first step):
                        # a wider value widens it instead of being cut ("15." for "15.3"). Only
                        # then: Textual re-measures the whole column when asked to fit a value.
                        wider = _width(new) > self.columns[ColumnKey(key)].content_width
                        if wider:
                            self._fit(((key, new),))
                        self.update_cell(str(r.rank), key, new, update_width=wider)
            self._shown[r.rank] = cells

    def _fit(self, cells: Iterable[tuple[str, object]]) -> None:
        """Widen the columns to the new cells now. Textual measures new rows and widened cells only
        when idle, and a row drawn before that (the cursor's row, highlighted as it is added) was
        cached at the old widths: it stayed one character short in a column its value filled."""
        for key, cell in cells:
            column = self.columns[ColumnKey(key)]
            column.content_width = max(column.content_width, _width(cell))

    def selected_rank(self) -> int | None:
        if not self.row_count:
            return None
        key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        return int(key) if key is not None else None
