"""The bucket timeline: ranks x collectives of one step, arrival lateness as colour."""

from __future__ import annotations

from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ddpdoctor.analysis.blame import NOISE_FLOOR_MS, NOISE_FLOOR_SHARE
from ddpdoctor.analysis.live_view import Heatmap, LiveSnapshot
from ddpdoctor_tui.formatting import lateness_colour

CELL = 6  # characters per collective


@lru_cache(maxsize=512)
def _cell_style(colour: str) -> Style:
    return Style.parse(f"black on {colour}")


_DIM = Style(dim=True)
_SELECTED = Style(reverse=True)


class BucketHeatmap(ScrollView):
    """One row per rank, one cell per collective (buffer broadcast, then buckets in firing order).

    The colour scale tops out at the straggler detector's own threshold, so red means "late
    enough to be named a straggler" and a healthy run stays green. A line-API widget: only the
    rows on screen are rendered, so 256 ranks cost what 20 do.
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.heat: Heatmap | None = None
        self.threshold_ms = NOISE_FLOOR_MS
        self.selected: int | None = None
        self._ranks: list[int] = []

    def show(self, snap: LiveSnapshot, selected: int | None, at_scale: bool = False) -> None:
        """Draw ``snap``'s heatmap with ``selected``'s row marked; ``at_scale``: the slowest ranks
        (what they cost the others) and the latest at this step first, not the lowest ranks."""
        heat = snap.heatmap
        self.heat, self.selected = heat, selected
        if heat is None:
            self.border_title = "bucket arrivals"
            self.border_subtitle = "no complete step yet"
            self._ranks = []
            self.virtual_size = Size(0, 1)
            self.refresh()
            return
        step_ms = next((t.median_ms for t in reversed(snap.step_times) if t.step == heat.step), 0.0)
        self.threshold_ms = max(NOISE_FLOOR_MS, NOISE_FLOOR_SHARE * step_ms)
        self.border_title = f"arrivals, step {heat.step}: late ms (red >= {self.threshold_ms:.0f})"
        worst = heat.worst()
        if worst is not None and worst[2] >= 1.0:
            rank, index, value = worst
            self.border_subtitle = f"latest: rank {rank} at {heat.collectives[index]}, +{value:.1f} ms"
        else:
            self.border_subtitle = "all ranks on time"
        self._ranks = list(heat.late_ms)
        if at_scale:
            self.border_title += ", slowest and latest first"
            cost = {r.rank: r.lost_for_others_ms or 0.0 for r in snap.ranks}
            late = {rank: max(row, default=0.0) for rank, row in heat.late_ms.items()}
            self._ranks.sort(key=lambda rank: (-cost.get(rank, 0.0), -late[rank], rank))
        self.virtual_size = Size(6 + CELL * len(heat.collectives), 1 + len(self._ranks))
        self.refresh()

    def text_lines(self) -> list[str]:
        """Every row as plain text (what ``render_line`` draws, for tests and snapshots)."""
        return [self._line(y).text for y in range(1 + len(self._ranks))]

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        strip = self._line(y + scroll_y)
        return strip.crop(scroll_x, scroll_x + self.size.width).extend_cell_length(self.size.width)

    def _line(self, y: int) -> Strip:
        heat = self.heat
        if heat is None:
            return Strip([Segment("waiting for a step that every rank logged", _DIM)]) if y == 0 else Strip.blank(0)
        if y == 0:
            return Strip(
                [Segment("rank  " + "".join(f"{name[: CELL - 1]:>{CELL - 1}} " for name in heat.collectives), _DIM)]
            )
        if y - 1 >= len(self._ranks):
            return Strip.blank(0)
        rank = self._ranks[y - 1]
        segments = [Segment(f"{rank:>4}", _SELECTED if rank == self.selected else None), Segment("  ")]
        for v in heat.late_ms[rank]:
            text = f"{v:{CELL - 1}.0f}" if v >= 1.0 else " " * (CELL - 2) + "."
            segments.append(Segment(text, _cell_style(lateness_colour(v, self.threshold_ms))))
            segments.append(Segment(" "))
        return Strip(segments)
