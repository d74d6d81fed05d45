"""Per-rank hot path: attaches to a DDP instance, times, checks, emits to a sink. Needs torch."""

from __future__ import annotations

from ddpdoctor.runtime.checks.replicas import check_replicas
from ddpdoctor.runtime.ddp import DistributedDataParallel
from ddpdoctor.runtime.monitor import Monitor, instrument
from ddpdoctor.runtime.rewrap import rewrap

__all__ = ["DistributedDataParallel", "Monitor", "check_replicas", "instrument", "rewrap"]
