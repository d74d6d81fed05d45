"""The options of a monitor, written once: ``instrument``, ``Monitor`` and the drop-in
``DistributedDataParallel`` all take an ``Options`` (or its fields as keywords)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ddpdoctor.sinks import Sink

#: Default interval of the sampled checks (fingerprints, unused parameters), in steps.
CHECK_EVERY = 50


@dataclass(frozen=True)
class Options:
    """How one DDP model is monitored.

    Attributes:
        run_dir: directory shared by all ranks' files. Default: ``$DDPDOCTOR_RUN_DIR``, else a new
            ``ddpdoctor-runs/<time>-<id>`` agreed with rank 0 through the rendezvous store.
        sink: where records go instead of the run dir (``MemorySink`` in tests, ``NullSink``). A
            sink that is not ddpdoctor's gets step records with list columns; ddpdoctor's own
            may get the native extension's ``Column``s (``Step.with_lists``).
        proc_interval: seconds between process statistics samples (CPU %, RSS, device memory).
        cuda_timing: time with CUDA events; default: when the model is on a CUDA device.
        check_every: interval, in steps, of the sampled checks (parameter and buffer fingerprints
            compared across ranks, unused parameters) once the run is past its dense start: they
            run at steps 0, 1, 3, 7, 15, ... (2**k - 1) up to ``check_every``, then every
            ``check_every`` steps, and once more at ``close()`` and at a clean exit.
        hang_timeout: seconds without progress before the hang watchdog records where this rank
            is (phase, step, pending bucket, stack) and flushes it. Default:
            ``$DDPDOCTOR_HANG_TIMEOUT``, else 120; 0 turns the watchdog off.
        endpoint: ``HOST:PORT`` of a ``ddpdoctor watch --listen`` or ``ddpdoctor collect`` to stream
            every record to as well (bounded queue, drops counted, never blocks training; the local
            file stays complete). Default: ``$DDPDOCTOR_ENDPOINT`` (when no ``sink`` is given).
        log: what the rank file keeps: "compact" (full per-bucket step records at sampled steps and
            around anything anomalous, a few numbers per step otherwise: ``sinks.compact``) or
            "full" (every step's full record). Default: ``$DDPDOCTOR_LOG``, else "compact".
            With CUDA timing, "full" also marks every bucket of every step with CUDA events;
            otherwise only at the sampled steps (timing events cost GPU time:
            ``runtime.step.recorder``).
    """

    run_dir: str | os.PathLike[str] | None = None
    sink: Sink | None = None
    proc_interval: float = 2.0
    cuda_timing: bool | None = None
    check_every: int = CHECK_EVERY
    hang_timeout: float | None = None
    endpoint: str | None = None
    log: str | None = None

    @classmethod
    def of(cls, options: Options | None = None, **overrides: Any) -> Options:
        """``options`` (or the defaults) with ``overrides``; an unknown name raises ``TypeError``."""
        base = options if options is not None else cls()
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown ddpdoctor option(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(base, **overrides) if overrides else base
