"""Findings as they appear, worst first, each with its fix; filtered by severity."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from ddpdoctor.analysis.findings import SEVERITY_ORDER, Finding
from ddpdoctor_tui.formatting import SEVERITY_STYLE

#: The filter cycle of the ``f`` key: everything, warnings and errors, errors only.
FILTERS: tuple[str, ...] = ("info", "warning", "error")


class FindingsPanel(VerticalScroll):
    """The findings of the run so far (live ones and those the ranks logged)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.min_severity = "info"
        self._findings: tuple[Finding, ...] = ()

    def compose(self) -> ComposeResult:
        yield Static(id="findings-text")

    def cycle_filter(self) -> str:
        """Next severity floor; returns it."""
        self.min_severity = FILTERS[(FILTERS.index(self.min_severity) + 1) % len(FILTERS)]
        self._render_findings()
        return self.min_severity

    def show(self, findings: tuple[Finding, ...]) -> None:
        if findings != self._findings:
            self._findings = findings
            self._render_findings()

    def _render_findings(self) -> None:
        floor = SEVERITY_ORDER[self.min_severity]
        shown = sorted(
            (f for f in self._findings if SEVERITY_ORDER[f.severity] >= floor),
            key=lambda f: -SEVERITY_ORDER[f.severity],
        )
        hidden = len(self._findings) - len(shown)
        self.border_title = f"findings ({len(shown)}, {self.min_severity} and worse" + (
            f", {hidden} hidden)" if hidden else ")"
        )
        out = Text()
        if not shown:
            out.append("no findings" + (" at this severity" if hidden else " so far"), style="dim")
        for f in shown:
            out.append(f"{f.severity.upper():<8}", style=SEVERITY_STYLE.get(f.severity, ""))
            out.append(f"{f.code}  ", style="bold")
            out.append(f"{f.title}\n")
            ranks = ", ".join(map(str, f.ranks[:16])) + (" ..." if len(f.ranks) > 16 else "")
            # a finding over the whole run (the bucket what-if) has no first step
            at = "" if f.step is None else f", step {f.step}"
            out.append(f"        ranks {ranks or '-'}{at}\n", style="dim")
            out.append(f"        fix: {f.fix}\n\n", style="green")
        self.query_one("#findings-text", Static).update(out)
