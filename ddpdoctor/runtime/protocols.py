"""The narrow interfaces the runtime's satellites use, instead of the whole ``Monitor``.

Each process-wide service (exit flush, optimizer hooks, process sampler, watchdog) and the comm
hook takes only what it calls. ``Monitor`` satisfies ``Closable`` and ``ProcSource``; its
``StepHooks`` (``step.hooks``) the others; tests may pass anything else that does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ddpdoctor.events import Record
    from ddpdoctor.runtime.probes import Probes
    from ddpdoctor.runtime.step.recorder import OpenStep, StepRecorder
    from ddpdoctor.sinks import Sink


class Closable(Protocol):
    """What ``exit_flush`` needs: flush now (a signal), close for good (the process ends)."""

    closed: bool

    def flush(self, timeout: float = 2.0) -> bool: ...

    def close(self, reason: str = "close", timeout: float = 5.0) -> None: ...


class OptimizerObserver(Protocol):
    """What the process-wide optimizer hooks call, or the C++ stamps they register instead."""

    def on_optimizer(self, start: bool) -> None: ...

    def optimizer_stamps(self) -> Any: ...


class Emitter(Protocol):
    """A rank's record stream with its probe switches (process sampler, watchdog)."""

    rank: int
    ddp_index: int
    closed: bool
    probes: Probes

    def emit(self, record: Record) -> None: ...


class ProcSource(Emitter, Protocol):
    """What the process sampler reads besides the stream."""

    def device_memory(self) -> tuple[int | None, int | None]: ...


class Watched(Emitter, Protocol):
    """What the hang watchdog reads: the step in progress and the sink to flush."""

    recorder: StepRecorder
    sink: Sink

    def buckets_in_flight(self) -> list[tuple[int, int, int, int, int]]: ...

    def backward_ended_in_flight(self) -> bool: ...

    def optimizer_running(self) -> bool: ...


class BucketObserver(Protocol):
    """What the timed comm hook calls on the training thread."""

    probes: Probes
    recorder: StepRecorder

    def on_bucket_ready(self, bucket: Any, index: int) -> OpenStep | None: ...
