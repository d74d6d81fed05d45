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

Where the runtime's native extension loads, the arithmetic done at every step (a step's phases
judged, a window's columns) runs there (``Compactor.accelerate``), with the same values: the
file's bytes do not depend on which ran.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

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
from ddpdoctor.events.schedule import DEFAULT_EVERY, DENSE_AT_LEAST

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

#: A step's values the phases are worked out from, in one C call (the writer runs this at every step)
_MARKS = operator.attrgetter(
    "end_us", "fwd_start_us", "fwd_us", "fwd_end_us", "bwd_end_us", "sync_end_us", "opt_start_us", "opt_end_us"
)
#: A window row's values, in one C call a row; ``zip(*...)`` turns the rows into columns
_ROW = operator.attrgetter(
    "t0_mono_ns",
    "t0_wall_ns",
    "micro",
    "fwd_start_us",
    "fwd_us",
    "bcast_start_us",
    "bcast_us",
    "fwd_end_us",
    "bwd_end_us",
    "sync_end_us",
    "opt_start_us",
    "opt_end_us",
    "end_us",
    "b_ready_us",
)


def _phases(s: Step) -> tuple[float | None, ...]:
    """The durations judged against their running medians (µs): the step, the data wait, the
    forward, the backward after it, the wait after the backward, the optimizer step."""
    end, fwd_start, fwd, fwd_end, bwd_end, sync_end, opt_start, opt_end = _MARKS(s)
    return (
        end,
        fwd_start,
        fwd,
        None if fwd_end is None or bwd_end is None else bwd_end - fwd_end,
        None if bwd_end is None or sync_end is None else sync_end - bwd_end,
        None if opt_start is None or opt_end is None else opt_end - opt_start,
    )


class _Medians:
    """Running medians of the phases over the last ``MEDIAN_OF`` values of each, refreshed every
    ``MEDIAN_EVERY`` steps.

    Between refreshes nothing reads the values, so a step's phases wait in ``_recent`` and go
    into the per-phase deques at the refresh, a column at a time: the medians see exactly the
    values a deque append per phase and step would have given them, for a list append a step."""

    def __init__(self, width: int) -> None:
        self.values: list[deque[float]] = [deque(maxlen=MEDIAN_OF) for _ in range(width)]
        self._judging: list[tuple[int, float]] = []  # (phase, limit) of the phases with a median
        self._recent: list[tuple[float | None, ...]] = []
        self.seen = 0
        #: the extension's ``judge_phases`` (``Compactor.accelerate``): the loop below, in C++
        self.native: Callable[[Step, list[tuple[int, float]], list[tuple[float | None, ...]]], bool] | None = None

    def judge(self, s: Step) -> bool:
        """True when one of the step's phases is far above its median; then adds them to the medians."""
        native = self.native
        if native is not None:
            slow = native(s, self._judging, self._recent)
        else:
            phases = _phases(s)
            slow = False
            for i, limit in self._judging:
                v = phases[i]
                if v is not None and v > limit:
                    slow = True
                    break
            self._recent.append(phases)
        self.seen += 1
        if self.seen % MEDIAN_EVERY == 0:
            self._refresh()
        return slow

    def _refresh(self) -> None:
        for values, column in zip(self.values, zip(*self._recent, strict=True), strict=True):
            values.extend([v for v in column if v is not None])
        self._recent = []
        if self.seen < WARMUP:
            return
        medians = [sorted(v)[len(v) // 2] if len(v) >= WARMUP else None for v in self.values]
        step = medians[0]  # the first phase is the whole step
        margin = max(SLOW_FLOOR_US, SLOW_STEP_SHARE * step) if step is not None else SLOW_FLOOR_US
        self._judging = [(i, SLOW_FACTOR * m + margin) for i, m in enumerate(medians) if m is not None]


def _column(values: list[int | None]) -> list[int | None]:
    return values if any(v is not None for v in values) else []


def _rounded(values: Sequence[float | None]) -> list[int | None]:
    """A phase column in whole µs (``_us`` of each value); empty when every value is None."""
    try:  # most columns hold no None: rounded in one C loop, without a pass to look for one
        return list(map(round, values))  # type: ignore[arg-type]
    except TypeError:  # round(None)
        return _column([None if v is None else round(v) for v in values])


#: t0, wall and micro hold ints; the other columns ints and None
_Columns = tuple[list[Any], ...]


def window_columns(rows: list[Step]) -> _Columns:
    """A window's columns: (t0, wall, micro, fwd_start, fwd, bcast_start, bcast, fwd_end, bwd_end,
    ready_first, ready_last, sync_end, opt_start, opt_end, end), as ``Window`` holds them. The
    extension's ``window_columns`` gives the same lists (``tests/test_compact_log.py``)."""
    first = rows[0]
    # the rows' values as columns: one C call a row and one transpose, not a pass a column
    (mono, wall_ns, micro, fwd_start, fwd, bcast_start, bcast, fwd_end, bwd_end, sync_end, opt_start, opt_end, end,
     ready_cols) = zip(*map(_ROW, rows), strict=True)  # fmt: skip
    base_mono, base_wall = first.t0_mono_ns, first.t0_wall_ns
    skew = base_wall - base_mono
    t0: list[int] = []
    previous = 0
    for m in mono:
        at = (m - base_mono + 500) // 1000  # rounded once, absolute: no drift over rows
        t0.append(at - previous)
        previous = at
    wall = [(w - m - skew + 500) // 1000 for w, m in zip(wall_ns, mono, strict=True)]
    # earliest and latest bucket ready per row (None values skipped; a row without any: None)
    ready_first: list[int | None] = []
    ready_last: list[int | None] = []
    for col in ready_cols:
        try:  # (a row with every bucket ready, the usual one, in two C calls)
            first_ready, last_ready = min(col), max(col)
        except (TypeError, ValueError):  # a None among them (TypeError), or no bucket (ValueError)
            ready = [t for t in col if t is not None]
            first_ready, last_ready = (min(ready), max(ready)) if ready else (None, None)
        ready_first.append(None if first_ready is None else round(first_ready))
        ready_last.append(None if last_ready is None else round(last_ready))
    return (
        t0,
        wall if any(wall) else [],
        list(micro) if any(micro) else [],
        _rounded(fwd_start),
        _rounded(fwd),
        _rounded(bcast_start),
        _rounded(bcast),
        _rounded(fwd_end),
        _rounded(bwd_end),
        _column(ready_first),
        _column(ready_last),
        _rounded(sync_end),
        _rounded(opt_start),
        _rounded(opt_end),
        _rounded(end),
    )


def window_of(rows: list[Step], key: _Key, columns: Callable[[list[Step]], _Columns | None] | None = None) -> Window:
    """The window record of consecutive steps that share ``key`` (``Compactor._step``'s);
    ``columns``: the extension's ``window_columns`` (None where it leaves a value to Python)."""
    cols = columns(rows) if columns is not None else None
    if cols is None:
        cols = window_columns(rows)
    (t0, wall, micro, fwd_start, fwd, bcast_start, bcast, fwd_end, bwd_end, ready_first, ready_last, sync_end,
     opt_start, opt_end, end) = cols  # fmt: skip
    first = rows[0]
    buckets, nbytes, bcast_bytes, clock, ddp = key
    return Window(
        rank=first.rank,
        ddp=ddp,
        step=first.step,
        n=len(rows),
        t0_mono_ns=first.t0_mono_ns,
        t0_wall_ns=first.t0_wall_ns,
        buckets=buckets,
        bytes=nbytes,
        bcast_bytes=bcast_bytes,
        clock=clock,
        t0=t0,
        wall=wall,
        micro=micro,
        fwd_start=fwd_start,
        fwd=fwd,
        bcast_start=bcast_start,
        bcast=bcast,
        fwd_end=fwd_end,
        bwd_end=bwd_end,
        ready_first=ready_first,
        ready_last=ready_last,
        sync_end=sync_end,
        opt_start=opt_start,
        opt_end=opt_end,
        end=end,
    )


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
        # the flight recorder's ring: its steps, and whether the file has each in full yet
        self._ring: deque[Step] = deque(maxlen=RING)
        self._ring_full: deque[bool] = deque(maxlen=RING)
        self._medians = _Medians(6)
        self._dense_below = max(every, DENSE_AT_LEAST)  # (events.schedule.is_sampled, inlined)
        # the last b_bytes list seen and its sum: the runtime hands every step of a layout the
        # same list object (it builds one when the sizes change, and never changes one)
        self._bytes_list: object = None
        self._bytes_sum = 0
        self._seen = 0
        self._after = 0
        self._key: _Key | None = None
        self.full_steps = 0  # full step records written (for tests and benchmarks)
        self.windows = 0
        self._columns: Callable[[list[Step]], _Columns | None] | None = None

    def accelerate(self, extension: object) -> None:
        """Do the per-step arithmetic with the runtime's native extension (``judge_phases``,
        ``window_columns``: the same values, for less of the writer's CPU) from now on. Called from the
        training thread while the writer runs: each attribute is set in one store, and either
        way gives the same bytes. An extension without them (an older build) changes nothing."""
        self._medians.native = getattr(extension, "judge_phases", None)
        self._columns = getattr(extension, "window_columns", None)

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
        # (runs at every step on the writer thread, holding the GIL: is_sampled inlined)
        b_bytes = s.b_bytes
        if b_bytes is not self._bytes_list:
            self._bytes_list = b_bytes
            # filter(None, ...) drops None (a bucket not seen) and 0, which adds nothing
            self._bytes_sum = sum(filter(None, b_bytes))
        # what every row of a window shares: bucket count, their bytes, broadcast bytes, clock, DDP
        key = (len(s.b_ready_us), self._bytes_sum, s.bcast_bytes, s.clock, s.ddp)
        changed = self._key is not None and key != self._key
        self._key = key
        slow = self._medians.judge(s)
        if slow or changed:
            self._incident(out)
        index = s.step
        every = self.every
        full = (
            self._after > 0
            or self._seen < FIRST_FULL
            or index % every == 0
            or (index < self._dense_below and (index + 1) & index == 0)
        )
        self._seen += 1
        if self._after > 0:
            self._after -= 1
        pending = self._pending
        if pending and (index != pending[-1].step + 1 or key != self._pending_key):
            self._flush(out)
            pending = self._pending
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
        self._ring.append(s)
        self._ring_full.append(full)

    def _incident(self, out: list[Record]) -> None:
        """Something happened: the ring's steps not yet written in full are, and so will the next ``AFTER``."""
        self._after = AFTER + 1  # this step too, when a step triggered it
        full = self._ring_full
        if all(full):
            return
        unwritten = [step for step, done in zip(self._ring, full, strict=True) if not done]
        in_ring = {id(step) for step in unwritten}
        # pending rows the ring holds go out in full instead; rows already in a window stay there
        # (the full record written after it wins when read back)
        self._pending = [s for s in self._pending if id(s) not in in_ring]
        self._flush(out)
        for i in range(len(full)):
            full[i] = True
        out.extend(unwritten)
        self.full_steps += len(unwritten)

    def _flush(self, out: list[Record]) -> None:
        if self._pending:
            out.append(window_of(self._pending, self._pending_key, self._columns))  # type: ignore[arg-type]  # set with the first row
            self.windows += 1
            self._pending = []
