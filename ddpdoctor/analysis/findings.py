"""Findings: what the analysis concludes, in the shape the report and warnings share."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "error"]
SEVERITY_ORDER: dict[str, int] = {"info": 0, "warning": 1, "error": 2}


@dataclass
class Finding:
    """One diagnosis. ``code`` is one of the stable codes in docs/reference/findings.md."""

    code: str
    severity: Severity
    title: str
    detail: str
    fix: str
    ranks: list[int] = field(default_factory=list)
    step: int | None = None  # first step where it was seen
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def at_least(findings: list[Finding], severity: Severity) -> list[Finding]:
    """The findings of ``severity`` or worse."""
    floor = SEVERITY_ORDER[severity]
    return [f for f in findings if SEVERITY_ORDER[f.severity] >= floor]
