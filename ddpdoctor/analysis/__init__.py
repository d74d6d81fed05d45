"""Pure functions from records to statistics and findings. Never imports torch."""

from __future__ import annotations

from ddpdoctor.analysis.findings import Finding, at_least
from ddpdoctor.analysis.report import Report, analyze

__all__ = ["Finding", "Report", "analyze", "at_least"]
