"""Timestamps for the hot path: host clocks on CPU, CUDA events on GPU.

A *mark* is whatever ``now()`` returns. Host marks are nanoseconds of the monotonic clock. CUDA
marks are events recorded on the current stream: reading the host clock would time the launch,
not the work, and synchronizing would change training; events are resolved later with
``query()`` (never blocking) once the GPU has passed them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from ddpdoctor.events import environment

Mark = Any


class HostClock:
    """Marks are ``time.perf_counter_ns()`` values (CLOCK_MONOTONIC on Linux)."""

    name = "host"
    always_ready = True  # nothing to wait for: the emitter skips the readiness check
    #: the builtin itself, not a method that calls it: a mark then costs no Python frame, and the
    #: hot path takes a dozen marks a step and three a bucket
    now = staticmethod(time.perf_counter_ns)

    def ready(self, marks: Iterable[Mark]) -> bool:
        return True

    def recycle(self, marks: Iterable[Mark]) -> None:
        return None

    def us(self, t0: Mark, mark: Mark | None) -> float | None:
        if mark is None:
            return None
        us: float = (mark - t0) / 1000.0  # integer ns / 1000: at most 3 decimals in the log
        return us

    def rel_us(self, t0: Mark, marks: Iterable[Mark | None]) -> list[float | None]:
        """``us(t0, m)`` of each mark, in one pass (the step record's lists: no call per mark)."""
        return [None if m is None else (m - t0) / 1000.0 for m in marks]


class CudaClock:
    """Marks are CUDA events recorded on the current stream; resolved without synchronizing."""

    name = "cuda"
    always_ready = False

    def __init__(self) -> None:
        import torch

        from ddpdoctor.runtime import torch_compat

        self._event = torch.cuda.Event
        self._pool: list[Any] = []
        self._record = torch_compat.cuda_event_recorder() or self._event.record

    def now(self) -> Mark:
        event = self._pool.pop() if self._pool else self._event(enable_timing=True)
        self._record(event)
        return event

    def ready(self, marks: list[Mark]) -> bool:
        """Whether the device has passed every mark (``query()``: never waits).

        Latest first: the step's last marks (buckets done, its end) are the ones still ahead of
        the device when a step is not ready, so a step still in flight costs a query or two, not
        one per mark up to the first pending one."""
        return all(m is None or m.query() for m in reversed(marks))

    def us(self, t0: Mark, mark: Mark | None) -> float | None:
        if mark is None:
            return None
        us: float = round(t0.elapsed_time(mark) * 1000.0, 1)
        return us

    def rel_us(self, t0: Mark, marks: Iterable[Mark | None]) -> list[float | None]:
        """``us(t0, m)`` of each mark."""
        return [self.us(t0, m) for m in marks]

    def recycle(self, marks: Iterable[Mark]) -> None:
        """Give resolved events back for reuse (creating events costs a driver call)."""
        # once each: a step holds some events under two names (its start and its forward's start;
        # a bucket's ready and launch), and an event in the pool twice would be handed out twice
        self._pool.extend({id(m): m for m in marks if m is not None}.values())
        del self._pool[4096:]


#: Wall and monotonic nanoseconds: the builtins themselves (no Python frame; every step reads both)
wall_ns: Callable[[], int] = time.time_ns
mono_ns: Callable[[], int] = time.perf_counter_ns


#: Test only: ``RANK:SECONDS`` shifts every host clock of the process whose ``$RANK`` is RANK
#: (wall, monotonic, bucket marks) by SECONDS, as another host's clocks would be. The reader
#: must line the ranks up anyway (``analysis.clock_align``); tests/test_clock_offset.py checks it.
TEST_OFFSET_ENV = environment.TEST_CLOCK_OFFSET_ENV


def _test_offset_ns() -> int:
    rank, _, seconds = environment.read(TEST_OFFSET_ENV).partition(":")
    if not seconds or os.environ.get("RANK") != rank:
        return 0
    try:
        return int(float(seconds) * 1e9)
    except ValueError:
        return 0


OFFSET_NS = _test_offset_ns()
if OFFSET_NS:  # rebound here, at import, so the hot path costs nothing when it is off

    def _offset_wall_ns() -> int:
        return time.time_ns() + OFFSET_NS

    def _offset_mono_ns() -> int:
        return time.perf_counter_ns() + OFFSET_NS

    wall_ns = _offset_wall_ns
    mono_ns = _offset_mono_ns
    HostClock.now = staticmethod(_offset_mono_ns)
