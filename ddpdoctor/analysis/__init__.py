"""Pure functions from records to statistics and findings. Never imports torch.

``Report`` and ``analyze`` (the whole report machinery, which reads ``runlog``) are imported on
first use: the runtime imports single detectors from here without loading the reading side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpdoctor.analysis.findings import Finding, at_least

if TYPE_CHECKING:
    from ddpdoctor.analysis.report import Report, analyze


def __getattr__(name: str) -> Any:
    if name in ("Report", "analyze"):
        from ddpdoctor.analysis import report

        return getattr(report, name)
    raise AttributeError(f"module 'ddpdoctor.analysis' has no attribute {name!r}")


__all__ = ["Finding", "Report", "analyze", "at_least"]
