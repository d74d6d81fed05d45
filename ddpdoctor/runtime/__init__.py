"""One rank's side: attaches to a DDP instance, times, checks, emits to a sink. Needs torch.

Here, cross-cutting: ``monitor`` (``Monitor``, ``instrument``), ``attach``, ``config``, ``header``,
``run_dir``, ``probes``, ``protocols``, ``rewrap``, ``ddp``, ``torch_compat``. By concern:
``step/`` (what runs at every step), ``checks/`` (the checks beside the timings), ``process/``
(what a process shares among its monitors), ``native/`` (the C++ source of the native hook).
"""

from __future__ import annotations

from ddpdoctor.runtime.checks.replicas import check_replicas
from ddpdoctor.runtime.ddp import DistributedDataParallel
from ddpdoctor.runtime.monitor import Monitor, instrument
from ddpdoctor.runtime.rewrap import rewrap

__all__ = ["DistributedDataParallel", "Monitor", "check_replicas", "instrument", "rewrap"]
