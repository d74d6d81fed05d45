"""ddpdoctor: see where every DDP training step's time goes, per bucket and per rank.

Names that need torch (``instrument``, ``DistributedDataParallel``) are imported on first use,
so ``import ddpdoctor`` and the reading side (``load_run``, ``analyze``) work without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpdoctor.analysis import Finding, Report, analyze
from ddpdoctor.categories import (
    AccumulationWarning,
    BufferWarning,
    CommHookWarning,
    DDPDoctorWarning,
    HangWarning,
    LogWriteWarning,
    PerformanceWarning,
    ProbeDisabledWarning,
    ReplicaDivergenceWarning,
    StaleRequiresGradWarning,
    UnusedParametersWarning,
)
from ddpdoctor.runlog import Run, RunDirError, load_run

if TYPE_CHECKING:
    from ddpdoctor.runtime import (
        DistributedDataParallel,
        Monitor,
        check_replicas,
        instrument,
        rewrap,
    )

__version__ = "0.1.0"

_LAZY = {"instrument", "DistributedDataParallel", "Monitor", "check_replicas", "rewrap"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from ddpdoctor import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'ddpdoctor' has no attribute {name!r}")


__all__ = [
    "AccumulationWarning",
    "BufferWarning",
    "CommHookWarning",
    "DDPDoctorWarning",
    "DistributedDataParallel",
    "Finding",
    "HangWarning",
    "LogWriteWarning",
    "Monitor",
    "PerformanceWarning",
    "ProbeDisabledWarning",
    "ReplicaDivergenceWarning",
    "Report",
    "Run",
    "RunDirError",
    "StaleRequiresGradWarning",
    "UnusedParametersWarning",
    "analyze",
    "check_replicas",
    "instrument",
    "load_run",
    "rewrap",
]
