"""The compact log: full step records where something can be learned from them, columns elsewhere.

Runs in the file writer's thread, never on the training thread: the runtime emits a full ``Step``
for every step, and ``Compactor`` decides what the file keeps of it.

- **Full ``step`` records** (every bucket's ready, launch and done times) for the first
  ``FIRST_FULL`` steps, at the sampled steps (``events.schedule.is_sampled``: the same step
  indices on every rank, where the runtime also takes its fingerprints), and around anything
  anomalous, flight-recorder style: the last ``RING`` steps are kept in memory and written in
  full when something happens, and so are the ``AFTER`` steps that follow. Something happens
  when a ``finding``, ``hang``, ``grad_flags``, ``probe_off`` or changed ``layout`` record goes
  by, when a step's bucket count or byte total changes (a bare step: a skipped backward), and
  when a step, or one of its phases (data, forward, backward, the wait after backward, the
  optimizer), takes more than ``SLOW_FACTOR`` times its running median plus the larger of
  ``SLOW_FLOOR_US`` and ``SLOW_STEP_SHARE`` times the median step: roughly, a step that took
  twice as long, and 10 ms more. Less is jitter on a busy host (a 2-rank gloo run on a shared
  2-core machine sees a wait of a whole step every hundred steps or so, and ms steps vary by
  several ms); counting it wrote most steps in full.
- **``window`` records** otherwise: one row per step in columns of whole µs (start, phases,
  first and last bucket ready), so every step of every rank is still there for cross-rank
  blame, stragglers and periodic patterns. A window closes at ``WINDOW_ROWS`` rows, when its
  rows span ``WINDOW_S`` seconds of the rank's clock, when ``WINDOW_S`` seconds passed since its
  first row reached the writer (a live tail lags by at most that plus one writer wake-up), and
  at every flush and close.

State is bounded: at most ``WINDOW_ROWS`` pending steps, the ring, and ``MEDIAN_OF`` values per
phase.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import cast

from ddpdoctor.events import (
    FindingRecord,
    Fingerprint,
    GradFlags,
    Hang,
    Layout,
    ProbeOff,
    ProcSample,
    Record,
    Step,
    StreamDrops,
    Unused,
    Window,
)
from ddpdoctor.events.schedule import DEFAULT_EVERY, is_sampled

FIRST_FULL = 8
#: Steps written in full before and after something happens. Eight and eight wrote 163-182 bytes a
#: rank-step on a healthy 2-rank run here (a slow all-reduce wait every 80 steps or so on a shared
#: 2-core machine, 13 full records each); four and four, 130-143 (BENCHMARKS.md). The steps
#: between are still there as window rows, with their phases.
RING = 4
AFTER = 4
WINDOW_ROWS = 256
WINDOW_S = 2.0
#: A phase is anomalous above SLOW_FACTOR x its running median + max(SLOW_FLOOR_US,
#: SLOW_STEP_SHARE x the median step).
SLOW_FACTOR = 2.0
SLOW_FLOOR_US = 10_000.0
SLOW_STEP_SHARE = 1.0
MEDIAN_OF = 64
MEDIAN_EVERY = 16
#: Steps seen before phases are judged against their medians.
WARMUP = 16

#: Records that pass through as they are, in any order relative to the steps.
_PASS = (ProcSample, Fingerprint, Unused, StreamDrops)
#: Records that say something happened: the steps around them are written in full.
_INCIDENT = (FindingRecord, Hang, GradFlags, ProbeOff)

_Key = tuple[int, int, int, str, int]


def _key(s: Step) -> _Key:
    """What every row of a window shares."""
    # filter(None, ...) drops None (a bucket not seen) and 0, which adds nothing: the same sum,
    # without a Python-level generator per step (the writer runs this at every step)
    return (len(s.b_ready_us), sum(filter(None, s.b_bytes)), s.bcast_bytes, s.clock, s.ddp)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _phases(s: Step) -> tuple[float | None, ...]:
    """The durations judged against their running medians (µs)."""
    return (
        s.end_us,
        s.fwd_start_us,
        s.fwd_us,
        _diff(s.fwd_end_us, s.bwd_end_us),
        _diff(s.bwd_end_us, s.sync_end_us),
        _diff(s.opt_start_us, s.opt_end_us),
    )


class _Medians:
    """Running medians of the phases over the last ``MEDIAN_OF`` steps, refreshed every ``MEDIAN_EVERY``."""

    def __init__(self, width: int) -> None:
        self.values: list[deque[float]] = [deque(maxlen=MEDIAN_OF) for _ in range(width)]
        self.limits: list[float | None] = [None] * width
        self.seen = 0

    def judge(self, phases: tuple[float | None, ...]) -> bool:
        """True when a phase is far above its median; then adds the phases to the medians."""
        # one loop, no generator: this runs at every step on the writer thread, holding the GIL
        slow = False
        for v, lim, values in zip(phases, self.limits, self.values, strict=True):
            if v is not None:
                if lim is not None and v > lim:
                    slow = True
                values.append(v)
        self.seen += 1
        if self.seen % MEDIAN_EVERY == 0 and self.seen >= WARMUP:
            medians = [sorted(v)[len(v) // 2] if len(v) >= WARMUP else None for v in self.values]
            step = medians[0]  # the first phase is the whole step
            margin = max(SLOW_FLOOR_US, SLOW_STEP_SHARE * step) if step is not None else SLOW_FLOOR_US
            self.limits = [None if m is None else SLOW_FACTOR * m + margin for m in medians]
        return slow


def _column(values: list[int | None]) -> list[int | None]:
    return values if any(v is not None for v in values) else []


def _rounded(values: list[float | None]) -> list[int | None]:
    """A phase column in whole µs (``_us`` of each value); empty when every value is None."""
    if None not in values:
        return [round(v) for v in values]  # type: ignore[arg-type]  # None was ruled out just above
    return _column([None if v is None else round(v) for v in values])


def window_of(rows: list[Step]) -> Window:
    """The window record of consecutive steps that share ``_key``."""
    first = rows[0]
    base_mono, base_wall = first.t0_mono_ns, first.t0_wall_ns
    skew = base_wall - base_mono
    t0: list[int] = []
    previous = 0
    for r in rows:
        at = (r.t0_mono_ns - base_mono + 500) // 1000  # rounded once, absolute: no drift over rows
        t0.append(at - previous)
        previous = at
    wall = [(r.t0_wall_ns - r.t0_mono_ns - skew + 500) // 1000 for r in rows]
    micro = [r.micro for r in rows]
    # earliest and latest bucket ready per row (None values skipped; a row without any: None)
    ready_first: list[int | None] = []
    ready_last: list[int | None] = []
    for r in rows:
        ready = [t for t in r.b_ready_us if t is not None] if None in r.b_ready_us else cast(list[float], r.b_ready_us)
        ready_first.append(round(min(ready)) if ready else None)
        ready_last.append(round(max(ready)) if ready else None)
    buckets, nbytes, bcast_bytes, clock, ddp = _key(first)
    return Window(
        rank=first.rank,
        ddp=ddp,
        step=first.step,
        n=len(rows),
        t0_mono_ns=base_mono,
        t0_wall_ns=base_wall,
        buckets=buckets,
        bytes=nbytes,
        bcast_bytes=bcast_bytes,
        clock=clock,
        t0=t0,
        wall=wall if any(wall) else [],
        micro=micro if any(micro) else [],
        fwd_start=_rounded([r.fwd_start_us for r in rows]),
        fwd=_rounded([r.fwd_us for r in rows]),
        bcast_start=_rounded([r.bcast_start_us for r in rows]),
        bcast=_rounded([r.bcast_us for r in rows]),
        fwd_end=_rounded([r.fwd_end_us for r in rows]),
        bwd_end=_rounded([r.bwd_end_us for r in rows]),
        ready_first=_column(ready_first),
        ready_last=_column(ready_last),
        sync_end=_rounded([r.sync_end_us for r in rows]),
        opt_start=_rounded([r.opt_start_us for r in rows]),
        opt_end=_rounded([r.opt_end_us for r in rows]),
        end=_rounded([r.end_us for r in rows]),
    )


class _Kept:
    """A step in the flight recorder's ring, and whether the file has it in full yet."""

    __slots__ = ("step", "full")

    def __init__(self, step: Step, full: bool) -> None:
        self.step = step
        self.full = full


class Compactor:
    """Turns the runtime's records into what the compact log keeps (see the module docstring).

    ``feed`` takes one record and appends what to write now to ``out``; ``tick`` (every writer
    wake-up) closes a window that waited ``WINDOW_S``; ``drain`` (flush, close) writes what is
    pending. Not thread-safe: the writer thread alone calls it.
    """

    def __init__(self, every: int = DEFAULT_EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self._clock = clock
        self._pending: list[Step] = []
        self._pending_key: _Key | None = None
        self._pending_since = 0.0
        self._ring: deque[_Kept] = deque(maxlen=RING)
        self._medians = _Medians(6)
        self._seen = 0
        self._after = 0
        self._key: _Key | None = None
        self.full_steps = 0  # full step records written (for tests and benchmarks)
        self.windows = 0

    def feed(self, record: Record, out: list[Record]) -> None:
        if isinstance(record, Step):
            self._step(record, out)
        elif isinstance(record, _PASS):
            out.append(record)
        elif isinstance(record, _INCIDENT) or (isinstance(record, Layout) and record.reason != "initial"):
            self._incident(out)
            out.append(record)
        else:  # header, layout, end: after the steps before them
            self._flush(out)
            out.append(record)

    def tick(self, out: list[Record]) -> None:
        if self._pending and self._clock() - self._pending_since >= WINDOW_S:
            self._flush(out)

    def drain(self, out: list[Record]) -> None:
        self._flush(out)

    def abandon(self) -> list[Step]:
        """The steps held back, given up for writing in full (after a failure here)."""
        pending, self._pending = self._pending, []
        return pending

    # -- steps -------------------------------------------------------------------------------

    def _step(self, s: Step, out: list[Record]) -> None:
        key = _key(s)
        changed = self._key is not None and key != self._key
        self._key = key
        slow = self._medians.judge(_phases(s))
        if slow or changed:
            self._incident(out)
        full = self._after > 0 or self._seen < FIRST_FULL or is_sampled(s.step, self.every)
        self._seen += 1
        if self._after > 0:
            self._after -= 1
        pending = self._pending
        if pending and (s.step != pending[-1].step + 1 or key != self._pending_key):
            self._flush(out)
        if full:
            self._flush(out)
            out.append(s)
            self.full_steps += 1
        else:
            if not pending:
                self._pending_key = key
                self._pending_since = self._clock()
            pending.append(s)
            if len(pending) >= WINDOW_ROWS or s.t0_mono_ns - pending[0].t0_mono_ns >= WINDOW_S * 1e9:
                self._flush(out)
        self._ring.append(_Kept(s, full))

    def _incident(self, out: list[Record]) -> None:
        """Something happened: the ring's steps not yet written in full are, and so will the next ``AFTER``."""
        self._after = AFTER + 1  # this step too, when a step triggered it
        unwritten = [kept for kept in self._ring if not kept.full]
        if not unwritten:
            return
        in_ring = {id(kept.step) for kept in unwritten}
        # pending rows the ring holds go out in full instead; rows already in a window stay there
        # (the full record written after it wins when read back)
        self._pending = [s for s in self._pending if id(s) not in in_ring]
        self._flush(out)
        for kept in unwritten:
            kept.full = True
            out.append(kept.step)
            self.full_steps += 1

    def _flush(self, out: list[Record]) -> None:
        if self._pending:
            out.append(window_of(self._pending))
            self.windows += 1
            self._pending = []
