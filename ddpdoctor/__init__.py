"""ddpdoctor: see where every DDP training step's time goes, per bucket and per rank.

Every name but the warning categories is imported on first use: a training rank that imports
the runtime loads none of the reading side (``load_run``, ``analyze``), and the reading side
loads no torch (``instrument``, ``DistributedDataParallel``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ddpdoctor.categories import (
    AccumulationWarning,
    BufferWarning,
    CommHookWarning,
    DDPDoctorWarning,
    HangWarning,
    LogWriteWarning,
    NonFiniteGradientWarning,
    NotSynchronizedWarning,
    PerformanceWarning,
    ProbeDisabledWarning,
    ReplicaDivergenceWarning,
    StaleRequiresGradWarning,
    UnusedParametersWarning,
)
from ddpdoctor.errors import DDPDoctorError, InputError, OutputError, SetupError

if TYPE_CHECKING:
    from ddpdoctor.analysis.findings import Finding
    from ddpdoctor.analysis.report import Report, analyze
    from ddpdoctor.runlog import Run, RunDirError, load_run
    from ddpdoctor.runtime import DistributedDataParallel, Monitor, check_replicas, instrument
    from ddpdoctor.runtime.rewrap import rewrap

__version__ = "0.1.0"

#: Public name -> the module that holds it.
_HOME = {
    "instrument": "ddpdoctor.runtime",
    "DistributedDataParallel": "ddpdoctor.runtime",
    "Monitor": "ddpdoctor.runtime",
    "check_replicas": "ddpdoctor.runtime",
    "rewrap": "ddpdoctor.runtime",
    "Finding": "ddpdoctor.analysis.findings",
    "Report": "ddpdoctor.analysis.report",
    "analyze": "ddpdoctor.analysis.report",
    "Run": "ddpdoctor.runlog",
    "RunDirError": "ddpdoctor.runlog",
    "load_run": "ddpdoctor.runlog",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'ddpdoctor' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = [
    "AccumulationWarning",
    "BufferWarning",
    "CommHookWarning",
    "DDPDoctorError",
    "DDPDoctorWarning",
    "DistributedDataParallel",
    "Finding",
    "HangWarning",
    "InputError",
    "LogWriteWarning",
    "NonFiniteGradientWarning",
    "NotSynchronizedWarning",
    "Monitor",
    "OutputError",
    "PerformanceWarning",
    "ProbeDisabledWarning",
    "ReplicaDivergenceWarning",
    "Report",
    "Run",
    "RunDirError",
    "SetupError",
    "StaleRequiresGradWarning",
    "UnusedParametersWarning",
    "analyze",
    "check_replicas",
    "instrument",
    "load_run",
    "rewrap",
]
