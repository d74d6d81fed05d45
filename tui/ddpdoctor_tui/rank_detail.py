"""The selected rank in detail: per-bucket numbers at the viewed step, and its stack when stalled."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from ddpdoctor.analysis.live_view import LiveSnapshot
from ddpdoctor_tui.formatting import ms, status_text


class RankDetail(VerticalScroll):
    """Per-bucket ready/done times, bytes and lateness; the hang watchdog's record and stack."""

    def compose(self) -> ComposeResult:
        yield Static(id="detail-text")

    def show(self, snap: LiveSnapshot, rank: int | None) -> None:
        view = next((r for r in snap.ranks if r.rank == rank), None)
        parts: list[RenderableType] = []
        if view is None:
            parts.append(Text("select a rank in the table (up/down)", style="dim"))
        else:
            self.border_title = f"rank {view.rank}"
            head = Text(f"rank {view.rank}  {view.host}  step {view.step if view.step is not None else '-'}  ")
            head.append_text(status_text(view.status, 0))
            if view.end_reason:
                head.append(f"  (end: {view.end_reason})", style="dim")
            parts.append(head)
            if view.hang is not None:
                h = view.hang
                pending = "" if h.pending_bucket is None else f", waiting for bucket {h.pending_bucket}"
                parts.append(
                    Text(
                        f"no progress for {h.waited_s:.0f} s in {h.phase} of step {h.step}{pending} "
                        f"({h.buckets_ready}/{h.buckets} buckets ready, {h.buckets_done} done)",
                        style="bold yellow",
                    )
                )
                parts.append(Text("stack (innermost last):\n" + "\n".join(h.stack[-20:]), style=""))
            if view.buckets:
                table = Table(box=None, pad_edge=False, header_style="bold")
                for col in ("coll", "ready ms", "done ms", "KiB", "late ms"):
                    table.add_column(col, justify="right")
                for b in view.buckets:
                    late = ms(b.late_ms)
                    table.add_row(
                        b.name,
                        ms(b.ready_ms),
                        ms(b.done_ms),
                        f"{b.bytes / 1024:.0f}",
                        Text(late, style="bold red" if (b.late_ms or 0.0) >= 10.0 else ""),
                    )
                parts.append(table)
        self.query_one("#detail-text", Static).update(Group(*parts))
