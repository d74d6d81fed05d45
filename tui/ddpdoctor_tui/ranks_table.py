"""The ranks table: one row per rank (or per host), its numbers at the viewed step and its status
in colour; sorted, filtered by rank or host, and rolled up per host on request."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from rich.text import Text
from textual import events
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from ddpdoctor.analysis.groups import ranks_text
from ddpdoctor.analysis.live_view import (
    AT_SCALE,
    LiveSnapshot,
    OutOfLine,
    RankView,
    host_ranks,
    live_out_of_line,
    node_rows,
)
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

#: What each sortable column sorts by: the worst first (the most of it), rank and host ascending.
SORTS: dict[str, Callable[[RankView], float | int | str | None]] = {
    "lost_for_others": lambda r: r.lost_for_others_ms,
    "late": lambda r: r.late_ms,
    "step_ms": lambda r: r.step_ms,
    "bwd": lambda r: r.bwd_ms,
    "fwd": lambda r: r.fwd_ms,
    "wait": lambda r: r.wait_ms,
    "bcast": lambda r: r.bcast_ms,
    "cpu": lambda r: r.cpu_pct,
    "rss": lambda r: r.rss_bytes,
    "step": lambda r: r.step,
    "status": lambda r: r.status,
    "rank": lambda r: r.rank,
    "host": lambda r: r.host,
}
#: The order the sort key cycles through (``s``); the rest by a click on their header.
SORT_CYCLE = ("lost_for_others", "late", "step_ms", "bwd", "fwd", "wait", "rank", "host")
ASCENDING = {"rank", "host"}
LABELS = dict(COLUMNS)


def _cells(r: RankView, label: str | None = None) -> tuple[object, ...]:
    late = Text(ms(r.late_ms), style="bold dark_orange" if (r.late_ms or 0.0) >= 10.0 else "")
    return (
        label if label is not None else str(r.rank),
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


def matches(text: str) -> Callable[[RankView], bool]:
    """The filter: words (spaces or commas between them) of which a row matches any. A number
    or a range ("96-103") matches ranks, anything else a part of the host name."""
    words = [w for w in re.split(r"[\s,]+", text.strip()) if w]
    ranges: list[tuple[int, int]] = []
    names: list[str] = []
    for w in words:
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", w)
        if m:
            ranges.append((int(m.group(1)), int(m.group(2) or m.group(1))))
        else:
            names.append(w.lower())
    if not words:
        return lambda r: True
    return lambda r: any(a <= r.rank <= b for a, b in ranges) or any(n in r.host.lower() for n in names)


class RanksTable(DataTable[object]):
    """Rows keyed by rank (or by host, rolled up): updated cell by cell while their order holds,
    so the cursor (the selected rank) stays put.

    Up to ``AT_SCALE`` ranks the rows are in rank order and the rank under the cursor is the one
    shown in detail, as ever. Above, they are sorted by what each rank cost the others (``s`` and a
    click on a header sort by another column), and the detail follows the worst rank until the
    user picks one (a key that moves the cursor, a click, enter)."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        for key, label in COLUMNS:
            self.add_column(label, key=key)
        self._shown: dict[str, tuple[object, ...]] = {}
        self._order: list[str] = []
        self.sort_key: str | None = None  # None: rank order up to AT_SCALE ranks, else by cost
        self.reverse = False  # the sort key's usual direction flipped (a second click on its header)
        self.filter_text = ""
        self.by_node = False
        #: the rank the user picked (None: the detail follows the worst rank, at scale)
        self.picked: int | None = None
        self.worst: int | None = None
        self.at_scale = False
        self.judged: OutOfLine | None = None  # the ranks and hosts out of line (at scale)
        self.shown_rows = 0
        self.total_rows = 0
        self._hosts: dict[int, str] = {}  # rank -> host
        self._first_rank: dict[str, int] = {}  # host -> its lowest rank

    # -- what the rows are ------------------------------------------------------------------------

    def effective_sort(self) -> str:
        return self.sort_key or ("lost_for_others" if self.at_scale else "rank")

    def _ordered(self, rows: Sequence[RankView], worst_first: Sequence[int]) -> list[RankView]:
        """``rows`` in the sort's order: numbers worst (largest) first, a missing one last; ties
        in the order of the ranks out of line (``worst_first``), then by rank."""
        key = self.effective_sort()
        get = SORTS[key]
        place = {r: i for i, r in enumerate(worst_first)}
        ascending = (key in ASCENDING) != self.reverse
        out = sorted(rows, key=lambda r: (place.get(r.rank, len(place)), r.rank))  # the ties' order
        present = [r for r in out if get(r) is not None]
        # stable, reversed too: the ties keep their order
        present.sort(key=lambda r: cast(Any, get(r)), reverse=not ascending)
        return present + [r for r in out if get(r) is None]

    def show(self, snap: LiveSnapshot) -> None:
        """Bring the rows up to ``snap``: sorted and filtered, per rank or rolled up per host."""
        self.at_scale = len(snap.ranks) > AT_SCALE
        self.judged = judged = live_out_of_line(snap.ranks) if self.at_scale else None
        worst_first = judged.order if judged is not None else ()
        ranks_by_cost = self._ordered_by_cost(snap.ranks, worst_first) if self.at_scale else []
        self.worst = ranks_by_cost[0].rank if ranks_by_cost else None
        keep = matches(self.filter_text)
        self._hosts = {r.rank: r.host or "?" for r in snap.ranks}
        rows: list[tuple[str, tuple[object, ...]]]
        if self.by_node:
            members = host_ranks(snap.ranks)
            self._first_rank = {host: ranks[0] for host, ranks in members.items()}
            kept_hosts = {r.host or "?" for r in snap.ranks if keep(r)}  # a host with any rank the filter keeps
            nodes = [n for n in node_rows(snap.ranks) if n.host in kept_hosts]
            self.total_rows = len(members)
            rows = [
                (f"host:{n.host}", _cells(n, ranks_text(members.get(n.host, [n.rank]))))
                for n in self._ordered(nodes, ())
            ]
        else:
            kept = [r for r in snap.ranks if keep(r)]
            self.total_rows = len(snap.ranks)
            rows = [(str(r.rank), _cells(r)) for r in self._ordered(kept, worst_first)]
        self.shown_rows = len(rows)
        order = [key for key, _ in rows]
        wanted = set(order)
        gone = [key for key in self._shown if key not in wanted]
        if len(gone) > len(wanted) or self.by_node != self._order_is_nodes():
            self.clear()  # most rows go (a filter, the roll-up): lay them out again
            self._shown, self._order = {}, []
        else:
            for key in gone:
                self.remove_row(key)
                del self._shown[key]
            self._order = [key for key in self._order if key in self._shown]
        added = [(key, cells) for key, cells in rows if key not in self._shown]
        # the new rows' widths once per column (not per cell: at 2,048 rows that was most of the time)
        if added:
            self._fit(
                (column, max((cells[i] for _, cells in added), key=_width)) for i, (column, _) in enumerate(COLUMNS)
            )
        for key, cells in rows:
            old = self._shown.get(key)
            if old is None:
                self.add_row(*cells, key=key)
                self._order.append(key)
            elif old != cells:
                for (column, _), new, was in zip(COLUMNS, cells, old, strict=True):
                    if new != was:
                        # a column is as wide as its first rows were ("-" before the first step):
                        # a wider value widens it instead of being cut ("15." for "15.3"). Only
                        # then: Textual re-measures the whole column when asked to fit a value.
                        wider = _width(new) > self.columns[ColumnKey(column)].content_width
                        if wider:
                            self._fit(((column, new),))
                        self.update_cell(key, column, new, update_width=wider)
            self._shown[key] = cells
        if self._order != order:
            # the same rows in another order: sorted in place (the row keys stay, the cursor's
            # row is put back below); each row's first cell, its rank or its host's ranks, is unique
            place = {cells[0]: i for i, (_, cells) in enumerate(rows)}
            self.sort("rank", key=lambda label: place[label])
            self._order = order
        if self.at_scale:
            self._put_cursor()
        self._title(judged is not None)

    def _ordered_by_cost(self, rows: Sequence[RankView], worst_first: Sequence[int]) -> list[RankView]:
        key, reverse = self.sort_key, self.reverse
        self.sort_key, self.reverse = "lost_for_others", False
        try:
            return self._ordered(rows, worst_first)
        finally:
            self.sort_key, self.reverse = key, reverse

    def _order_is_nodes(self) -> bool:
        return bool(self._order) and self._order[0].startswith("host:")

    def _put_cursor(self) -> None:
        """At scale the cursor sits on the rank shown in detail: the one picked, else the worst."""
        rank = self.detail_rank()
        key = f"host:{self._host_of(rank)}" if self.by_node and rank is not None else str(rank)
        if rank is None or key not in self._shown:
            return
        index = self.get_row_index(key)
        if self.cursor_row != index:
            self.move_cursor(row=index, animate=False)

    def _host_of(self, rank: int | None) -> str:
        return self._hosts.get(rank, "?") if rank is not None else "?"

    def _title(self, at_scale: bool) -> None:
        how = f"sorted by {LABELS[self.effective_sort()]}{' (reversed)' if self.reverse else ''}"
        what = "hosts" if self.by_node else "ranks"
        shown = f"{self.shown_rows} of {self.total_rows} {what}"
        filtered = f", filter '{self.filter_text}'" if self.filter_text else ""
        follow = ""
        if at_scale:
            picked = self.picked
            follow = f"; detail: rank {picked} (w: the worst)" if picked is not None else "; detail: the worst"
        busy = at_scale or self.sort_key or filtered or self.by_node
        self.border_subtitle = f"{shown}{filtered}, {how}{follow}" if busy else ""

    def _fit(self, cells: Iterable[tuple[str, object]]) -> None:
        """Widen the columns to the new cells now. Textual measures new rows and widened cells only
        when idle, and a row drawn before that (the cursor's row, highlighted as it is added) was
        cached at the old widths: it stayed one character short in a column its value filled."""
        for key, cell in cells:
            column = self.columns[ColumnKey(key)]
            column.content_width = max(column.content_width, _width(cell))

    # -- which rank the detail shows --------------------------------------------------------------

    def selected_rank(self) -> int | None:
        """The rank of the row under the cursor (a host's row: its lowest rank)."""
        if not self.row_count:
            return None
        key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        if key is None:
            return None
        if key.startswith("host:"):
            return self._first_rank.get(key[5:])
        return int(key)

    def detail_rank(self) -> int | None:
        """The rank the detail and the heatmap's marker show: at scale the one picked, else the
        worst; up to ``AT_SCALE`` ranks the one under the cursor."""
        if not self.at_scale:
            return self.selected_rank()
        return self.picked if self.picked is not None else self.worst

    def _pick(self) -> None:
        if self.at_scale:
            self.picked = self.selected_rank()

    def follow_worst(self) -> None:
        """Let the detail follow the worst rank again."""
        self.picked = None
        self._put_cursor()

    def action_cursor_up(self) -> None:
        super().action_cursor_up()
        self._pick()

    def action_cursor_down(self) -> None:
        super().action_cursor_down()
        self._pick()

    def action_page_up(self) -> None:
        super().action_page_up()
        self._pick()

    def action_page_down(self) -> None:
        super().action_page_down()
        self._pick()

    def action_scroll_top(self) -> None:
        super().action_scroll_top()
        self._pick()

    def action_scroll_bottom(self) -> None:
        super().action_scroll_bottom()
        self._pick()

    def action_select_cursor(self) -> None:
        super().action_select_cursor()
        self._pick()

    async def _on_click(self, event: events.Click) -> None:
        await super()._on_click(event)
        if event.style.meta.get("row", -1) >= 0:
            self._pick()

    # -- sorting, filtering, rolling up -----------------------------------------------------------

    def sort_by(self, column: str | None) -> None:
        """Sort by ``column`` (its worst first); the same column again: the other way round."""
        if column is not None and column not in SORTS:
            return
        if column == self.effective_sort():
            self.reverse = not self.reverse
        else:
            self.sort_key, self.reverse = column, False

    def cycle_sort(self) -> str:
        """The next sort key of ``SORT_CYCLE``; its label."""
        current = self.effective_sort()
        i = SORT_CYCLE.index(current) if current in SORT_CYCLE else -1
        self.sort_key, self.reverse = SORT_CYCLE[(i + 1) % len(SORT_CYCLE)], False
        return LABELS[self.sort_key]
