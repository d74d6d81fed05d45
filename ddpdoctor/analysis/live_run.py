"""Where the ranks' streams meet, live: bounded state for ``ddpdoctor watch`` fed from any record source.

``LiveRun.feed`` takes the records a :class:`~ddpdoctor.runlog.source.RecordSource` polled (a run
dir being written or a stream, the same here) and keeps only a sliding window of each rank's
recent steps, so memory stays flat over a run of any length. ``LiveRun.snapshot`` returns an
immutable view for the UI: per-rank numbers and status, the cross-rank bucket arrivals of a
step (the heatmap), step-time history and the findings so far.

The cross-rank analysis is the same as the report's (a finding is defined once): clock offsets
from ``clock_align``, arrivals from ``bucket_wait``, stragglers from ``straggler`` over the last
``window`` complete steps, lost ranks from ``lost``, hangs from ``hang`` (with each rank's
latest steps logged without any all-reduce, which name a skipped backward). No textual, no torch.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from statistics import median
from typing import Any

from ddpdoctor.analysis.bucket_size import RankBackward, bucket_size
from ddpdoctor.analysis.bucket_wait import StepArrivals, arrivals
from ddpdoctor.analysis.clock_align import ClockOffsets, estimate_offsets
from ddpdoctor.analysis.findings import SEVERITY_ORDER, Finding
from ddpdoctor.analysis.hang import COLLECTIVE_PHASES, hang_findings, steps_without_allreduce
from ddpdoctor.analysis.lost import RankTail, lost_ranks
from ddpdoctor.analysis.straggler import stragglers
from ddpdoctor.events import End, FindingRecord, Hang, Header, Layout, ProcSample, Step, Unused
from ddpdoctor.runlog.source import RankRecord, RecordSource, SourceHealth

#: Steps of history kept per rank (the table, heatmap and chart can be stepped back over these).
HISTORY = 200
#: Complete steps the live straggler check looks at: short, so a new straggler is named within
#: ~``WINDOW`` steps, long enough for the detector's majority rule to ignore one slow step.
WINDOW = 10
#: Complete steps between two re-estimates of the clock offsets (they drift slowly).
CLOCK_EVERY = 20
#: From this many ranks on, the straggler check runs every other complete step.
LARGE_RUN = 64
#: The bucket what-if runs every this many complete steps (and once the run finished), over at
#: most ``WHATIF_RANKS`` ranks' recent steps and sampled backward passes.
WHATIF_EVERY, WHATIF_RANKS, WHATIF_SAMPLES = 100, 8, 16
#: Steps logged without any all-reduce kept per rank (the latest: a skipped backward that hangs
#: the job is among a rank's last steps), for the hang finding to name.
BARE_STEPS = 64

STATUSES = ("running", "straggler", "stalled", "hung", "finished", "terminated", "failed", "lost")


@dataclass(frozen=True)
class BucketView:
    """One collective of one rank at the viewed step (ms from the step's start; lateness on aligned clocks)."""

    name: str  # "bcast" for the buffer broadcast, else "b0", "b1", ...
    ready_ms: float | None
    done_ms: float | None
    bytes: int
    late_ms: float | None  # behind the earliest rank at this collective


@dataclass(frozen=True)
class RankView:
    """One row of the ranks table."""

    rank: int
    host: str
    step: int | None
    step_ms: float | None
    fwd_ms: float | None
    bwd_ms: float | None
    wait_ms: float | None  # blocked in the step's collectives for slower ranks
    bcast_ms: float | None  # buffer broadcast inside forward
    late_ms: float | None  # behind the earliest rank (at the collective it was latest for)
    cpu_pct: float | None
    rss_bytes: int | None
    status: str
    hang: Hang | None = None  # the watchdog's last word while stalled (phase, pending bucket, stack)
    buckets: tuple[BucketView, ...] = ()
    end_reason: str | None = None


@dataclass(frozen=True)
class Heatmap:
    """Arrival lateness of every rank at every collective of one step."""

    step: int
    collectives: tuple[str, ...]
    late_ms: dict[int, tuple[float, ...]]  # rank -> per collective

    def worst(self) -> tuple[int, int, float] | None:
        """(rank, collective index, ms) of the latest arrival."""
        best: tuple[int, int, float] | None = None
        for rank, row in self.late_ms.items():
            for i, v in enumerate(row):
                if best is None or v > best[2]:
                    best = (rank, i, v)
        return best


@dataclass(frozen=True)
class StepTime:
    """Step time across ranks at one step (ms)."""

    step: int
    min_ms: float
    median_ms: float
    max_ms: float


@dataclass(frozen=True)
class LiveSnapshot:
    """What the UI shows, frozen at one moment. ``view_step`` None: following the latest step."""

    label: str
    run_id: str
    world_size: int
    backend: str
    device: str
    ranks: tuple[RankView, ...]
    steps: tuple[int, ...]  # complete steps that can be viewed (oldest first)
    view_step: int | None  # the step shown (the latest complete one when following)
    latest_step: int | None  # highest step any rank logged
    heatmap: Heatmap | None
    step_times: tuple[StepTime, ...]
    findings: tuple[Finding, ...]
    health: str  # "waiting", "ok", "warning", "error"
    steps_per_s: float | None
    finished: bool  # every rank closed its log
    source: SourceHealth
    records: int  # records fed so far
    attempt: int | None = None  # the elastic attempt shown (None: not elastic, or not known)


EMPTY_HEALTH = SourceHealth(0, 0, 0)


@dataclass
class _RankState:
    rank: int
    header: Header | None = None
    steps: deque[Step] = field(default_factory=deque)
    proc: ProcSample | None = None
    end: End | None = None
    hang: Hang | None = None  # the watchdog's record while this rank is stalled
    last_hang: Hang | None = None  # latest watchdog record, stalled or resumed
    buckets: int = 0  # from the latest layout
    last_wall_ns: int = 0  # newest wall time in any of its records
    sampled: deque[Unused] = field(default_factory=lambda: deque(maxlen=WHATIF_SAMPLES))  # with ready times
    bare: deque[int] = field(default_factory=lambda: deque(maxlen=BARE_STEPS))  # steps without any bucket


def _step_wall_ns(s: Step) -> int:
    return s.t0_wall_ns + int((s.end_us or s.sync_end_us or s.fwd_end_us or 0.0) * 1000)


def _ms(v: float | None) -> float | None:
    return None if v is None else v / 1000.0


class LiveRun:
    """Bounded live state of one run, fed record batches, read as immutable snapshots.

    Not thread-safe: one thread feeds and snapshots (the UI's watcher thread).
    """

    def __init__(self, label: str = "", history: int = HISTORY, window: int = WINDOW,
                 attempt: int | None = None) -> None:
        self.label = label
        self.attempt = attempt  # one elastic attempt per LiveRun: a restart starts a new one
        self.history = max(history, window + 1)
        self.window = window
        self._ranks: dict[int, _RankState] = {}
        self._world_size = 0
        self._pending: dict[int, set[int]] = {}  # step -> ranks that logged it, until complete
        self._complete: deque[int] = deque(maxlen=self.history)
        self._arrivals: dict[int, StepArrivals] = {}
        self._step_times: deque[StepTime] = deque(maxlen=self.history)
        self._clocks: ClockOffsets | None = None
        self._clock_age = 0
        self._findings: dict[tuple[Any, ...], Finding] = {}  # in order of first appearance
        self._stragglers: set[int] = set()
        self._checked_upto: int | None = None
        self._source = EMPTY_HEALTH
        self._records = 0
        self._whatif_at: int | None = None  # complete step of the last bucket what-if
        self._whatif_final = False

    # -- feeding ------------------------------------------------------------------------------

    def feed(self, records: Iterable[RankRecord]) -> None:
        """Take a batch of records (any ranks, arrival order per rank)."""
        for rr in records:
            if rr.ddp != 0:
                continue  # a second DDP model in a process: the live view follows the first
            self._records += 1
            self._add(rr.rank, rr.record)
        self._check_stragglers()
        self._check_bucket_size()

    def set_source_health(self, health: SourceHealth) -> None:
        self._source = health

    def _state(self, rank: int) -> _RankState:
        st = self._ranks.get(rank)
        if st is None:
            st = self._ranks[rank] = _RankState(rank, steps=deque(maxlen=self.history))
        return st

    def _add(self, rank: int, rec: object) -> None:
        st = self._state(rank)
        if isinstance(rec, Step):
            if st.steps and rec.step <= st.steps[-1].step:
                return  # read again (a file replaced under us) or out of order: already counted
            st.steps.append(rec)
            if not rec.b_ready_us:
                st.bare.append(rec.step)
            st.last_wall_ns = max(st.last_wall_ns, _step_wall_ns(rec))
            if st.hang is not None and st.hang.state == "stalled" and rec.step >= st.hang.step:
                st.hang = None  # progress came back
            self._step_logged(rank, rec.step)
        elif isinstance(rec, ProcSample):
            st.proc = rec
            st.last_wall_ns = max(st.last_wall_ns, rec.t_wall_ns)
        elif isinstance(rec, Header):
            if rec.reason == "attach" and st.header is not None and (st.steps or st.end):
                self._reset_rank(rank)  # the file was replaced: a new run under the same name
                st = self._state(rank)
            st.header = rec
            self._world_size = max(self._world_size, rec.world_size)
            st.last_wall_ns = max(st.last_wall_ns, rec.t_wall_ns)
        elif isinstance(rec, Layout):
            st.buckets = len(rec.buckets)
        elif isinstance(rec, Unused):
            if rec.param_ready_us:
                st.sampled.append(rec)
        elif isinstance(rec, Hang):
            st.hang = rec if rec.state == "stalled" else None
            st.last_hang = rec
            st.last_wall_ns = max(st.last_wall_ns, rec.t_wall_ns)
        elif isinstance(rec, End):
            st.end = rec
            st.last_wall_ns = max(st.last_wall_ns, rec.t_wall_ns)
        elif isinstance(rec, FindingRecord):
            key = ("logged", rec.code)
            old = self._findings.get(key)
            ranks = sorted(set(old.ranks if old else []) | set(rec.ranks or [rank]))
            if old is None:
                self._findings[key] = Finding(code=rec.code, severity=rec.severity, title=rec.title,  # type: ignore[arg-type]
                                              detail=rec.detail, fix=rec.fix, ranks=ranks, step=rec.step,
                                              evidence=dict(rec.evidence))
            elif ranks != old.ranks:
                self._findings[key] = dataclasses.replace(old, ranks=ranks)

    def _reset_rank(self, rank: int) -> None:
        del self._ranks[rank]
        for ranks in self._pending.values():
            ranks.discard(rank)
        self._clocks = None

    def _expected(self) -> int:
        return max(self._world_size, len(self._ranks))

    def _step_logged(self, rank: int, step: int) -> None:
        if self._complete and step <= self._complete[-1] - self.history:
            return
        ranks = self._pending.setdefault(step, set())
        ranks.add(rank)
        if len(ranks) >= self._expected():
            del self._pending[step]
            self._step_complete(step)
        if len(self._pending) > 2 * self.history:  # a rank that stopped: don't hoard its steps
            for old in sorted(self._pending)[: len(self._pending) - 2 * self.history]:
                del self._pending[old]

    def _steps_at(self, step: int) -> dict[int, Step]:
        out = {}
        for rank, st in self._ranks.items():
            s = self._find(st, step)
            if s is not None:
                out[rank] = s
        return out

    @staticmethod
    def _find(st: _RankState, step: int) -> Step | None:
        if not st.steps:
            return None
        i = step - st.steps[0].step
        if 0 <= i < len(st.steps) and st.steps[i].step == step:
            return st.steps[i]  # the usual case: consecutive step numbers
        for s in reversed(st.steps):
            if s.step == step:
                return s
            if s.step < step:
                break
        return None

    def _step_complete(self, step: int) -> None:
        if self._complete and step <= self._complete[-1]:
            return  # completed again after a rank's file was read anew: the view never goes back
        by_rank = self._steps_at(step)
        if len(by_rank) < len(self._ranks):
            return
        if self._clocks is None or self._clock_age >= CLOCK_EVERY or any(r not in self._clocks.offset_us for r in by_rank):
            recent = {r: list(st.steps)[-self.window:] for r, st in self._ranks.items()}
            self._clocks, self._clock_age = estimate_offsets(recent), 0
        self._clock_age += 1
        found = arrivals({r: [s] for r, s in by_rank.items()}, self._clocks)
        if found:
            self._arrivals[step] = found[0]
        ends = [s.end_us / 1000.0 for s in by_rank.values() if s.end_us is not None]
        if ends:
            self._step_times.append(StepTime(step, min(ends), median(ends), max(ends)))
        if len(self._complete) == self._complete.maxlen:
            self._arrivals.pop(self._complete[0], None)
        self._complete.append(step)

    # -- cross-rank live findings ---------------------------------------------------------------

    def _check_stragglers(self) -> None:
        if not self._complete or self._complete[-1] == self._checked_upto or len(self._ranks) < 2:
            return
        # the check costs O(ranks x window): on large runs, every other step (still named within the window)
        if len(self._ranks) >= LARGE_RUN and self._checked_upto is not None and self._complete[-1] < self._checked_upto + 2:
            return
        self._checked_upto = self._complete[-1]
        recent = [s for s in list(self._complete)[-self.window:] if s in self._arrivals]
        if len(recent) < 3:
            return
        wanted = set(recent) | {s - 1 for s in recent}  # the step before: the data-loading gap
        tail = self.window + 2
        steps_by_rank = {r: [s for s in list(islice(reversed(st.steps), tail))[::-1] if s.step in wanted]
                         for r, st in self._ranks.items()}
        found = stragglers(steps_by_rank, [self._arrivals[s] for s in recent])
        self._stragglers = {r for f in found for r in f.ranks}
        for f in found:
            key = ("straggler", f.ranks[0])
            old = self._findings.get(key)
            seen = old.evidence["live_seen_at_step"] if old else self._checked_upto
            self._findings[key] = dataclasses.replace(f, step=old.step if old else f.step,
                                                      evidence={**f.evidence, "live_seen_at_step": seen})

    def _check_bucket_size(self) -> None:
        """The report's bucket-size finding over the recent window, now and then (it replays backward passes)."""
        if not self._complete:
            return
        finished = bool(self._ranks) and all(st.end is not None for st in self._ranks.values())
        last = self._complete[-1]
        due = self._whatif_at is None or last >= self._whatif_at + WHATIF_EVERY
        if not (due or (finished and not self._whatif_final)):
            return
        self._whatif_at, self._whatif_final = last, finished
        ranks = {rank: RankBackward(header=self._ranks[rank].header, steps=list(self._ranks[rank].steps),
                                    unused=list(self._ranks[rank].sampled))
                 for rank in sorted(self._ranks)[:WHATIF_RANKS]}
        try:
            found = bucket_size(ranks)
        except (ValueError, ZeroDivisionError, KeyError):  # a window too thin to replay: try again later
            return
        self._findings.pop(("bucket-size",), None)
        for f in found:
            self._findings[("bucket-size",)] = f

    def _lost(self) -> set[int]:
        if len(self._ranks) < 2:
            return set()
        found = lost_ranks({rank: RankTail(header=st.header, last_step=st.steps[-1] if st.steps else None,
                                           last_proc=st.proc, end=st.end)
                            for rank, st in self._ranks.items()})
        for f in found:
            self._findings.setdefault(("rank-lost", f.ranks[0]), f)
        return {r for f in found for r in f.ranks}

    def _hangs(self) -> set[int]:
        """Ranks that are part of a hang now (waiting in a collective that cannot complete)."""
        latest = {r: st.last_hang for r, st in self._ranks.items() if st.last_hang is not None}
        stalled = {r for r, st in self._ranks.items() if st.hang is not None and st.end is None}
        if not latest:
            return set()
        last = {r: (st.steps[-1].step if st.steps else None) for r, st in self._ranks.items()}
        ended = {r: st.end.reason for r, st in self._ranks.items() if st.end is not None}
        current = {r: h for r, h in latest.items() if r in stalled or h.state == "resumed"}
        try:
            skipped = None
            if any(h.state == "stalled" and h.phase in COLLECTIVE_PHASES for h in current.values()):
                bare = {r: list(st.bare) for r, st in self._ranks.items() if st.bare}
                skipped = steps_without_allreduce(bare, last, latest)  # names a skipped backward
            found = hang_findings(current, last, self._expected(), ended=ended, no_allreduce_steps=skipped)
        except Exception:  # noqa: BLE001 - the live view must not die of one detector's bug
            found = []
        hung = False
        for f in found:
            self._findings[("hang", f.severity, tuple(f.ranks))] = f
            hung = hung or f.severity == "error"
        # in a hang every stalled rank is hung, as the report says; the finding names the
        # missing rank and where it is
        return stalled if hung else set()

    # -- reading --------------------------------------------------------------------------------

    def snapshot(self, at_step: int | None = None) -> LiveSnapshot:
        """The view at ``at_step`` (a complete step), or at the latest complete step when None."""
        complete = tuple(self._complete)
        if at_step is not None and complete:
            at_step = min(max(at_step, complete[0]), complete[-1])
        view = at_step if at_step is not None else (complete[-1] if complete else None)
        following = at_step is None
        lost = self._lost()
        hung = self._hangs()
        arr = self._arrivals.get(view) if view is not None else None
        heat = None
        rows = []
        for rank in sorted(self._ranks):
            st = self._ranks[rank]
            s = (st.steps[-1] if st.steps else None) if following else self._find(st, view)  # type: ignore[arg-type]
            lat = arr.lateness_us.get(rank) if arr is not None and (s is None or s.step == view) else None
            rows.append(self._row(st, s, arr, lat, lost, hung))
        if arr is not None:
            n = len(next(iter(arr.lateness_us.values()), []))
            has_bcast = any(s.bcast_start_us is not None for s in self._steps_at(view).values())  # type: ignore[arg-type]
            names = (["bcast"] if has_bcast else []) + [f"b{i}" for i in range(n - (1 if has_bcast else 0))]
            heat = Heatmap(step=arr.step, collectives=tuple(names),
                           late_ms={r: tuple(v / 1000.0 for v in lat) for r, lat in sorted(arr.lateness_us.items())})
        headers = [st.header for st in self._ranks.values() if st.header is not None]
        h0 = min(headers, key=lambda h: h.rank) if headers else None
        # a rank's own finding (its watchdog's hang) gives way to the cross-rank one of the same code
        crossed = {key[0] for key in self._findings if key[0] != "logged"}
        findings = tuple(f for key, f in self._findings.items() if not (key[0] == "logged" and key[1] in crossed))
        statuses = {r.status for r in rows}
        worst = max((SEVERITY_ORDER[f.severity] for f in findings), default=-1)
        if not rows:
            health = "waiting"
        elif worst >= 2 or statuses & {"hung", "lost", "failed"}:
            health = "error"
        elif worst >= 1 or statuses & {"straggler", "stalled", "terminated"}:
            health = "warning"
        else:
            health = "ok"
        latest = max((st.steps[-1].step for st in self._ranks.values() if st.steps), default=None)
        return LiveSnapshot(
            label=self.label, run_id=h0.run_id if h0 else "", world_size=self._expected(),
            backend=h0.backend if h0 else "", device=h0.device if h0 else "", ranks=tuple(rows), steps=complete,
            view_step=view, latest_step=latest, heatmap=heat, step_times=tuple(self._step_times),
            findings=findings, health=health, steps_per_s=self._rate(),
            finished=bool(self._ranks) and all(st.end is not None for st in self._ranks.values())
            and len(self._ranks) >= self._world_size,
            source=self._source, records=self._records, attempt=self.attempt,
        )

    def _row(self, st: _RankState, s: Step | None, arr: StepArrivals | None, lat: list[float] | None,
             lost: set[int], hung: set[int]) -> RankView:
        if st.end is not None:
            reason = st.end.reason
            status = "failed" if reason.startswith("error") else "terminated" if reason == "signal" else "finished"
        elif st.rank in lost:
            status = "lost"
        elif st.rank in hung:
            status = "hung"
        elif st.hang is not None:
            status = "stalled"
        elif st.rank in self._stragglers:
            status = "straggler"
        else:
            status = "running"
        buckets: list[BucketView] = []
        if s is not None:
            has_bcast = s.bcast_start_us is not None
            if has_bcast:
                start = s.bcast_start_us or 0.0
                buckets.append(BucketView("bcast", _ms(start), _ms(start + (s.bcast_us or 0.0)), s.bcast_bytes,
                                          lat[0] / 1000.0 if lat else None))
            off = 1 if has_bcast else 0
            for i, ready in enumerate(s.b_ready_us):
                done = s.b_done_us[i] if i < len(s.b_done_us) else None
                nbytes = s.b_bytes[i] if i < len(s.b_bytes) else 0
                late = lat[i + off] / 1000.0 if lat and i + off < len(lat) else None
                buckets.append(BucketView(f"b{i}", _ms(ready), _ms(done), nbytes, late))
        bwd = s.bwd_end_us - s.fwd_end_us if s is not None and s.bwd_end_us is not None and s.fwd_end_us is not None else None
        wait = arr.wait_us.get(st.rank) if arr is not None and lat is not None else None
        return RankView(
            rank=st.rank, host=st.header.host if st.header else "", step=s.step if s else None,
            step_ms=_ms(s.end_us) if s else None, fwd_ms=_ms(s.fwd_us) if s else None, bwd_ms=_ms(bwd),
            wait_ms=_ms(wait), bcast_ms=_ms(s.bcast_us) if s else None,
            late_ms=max(lat) / 1000.0 if lat else None,
            cpu_pct=st.proc.cpu_pct if st.proc else None, rss_bytes=st.proc.rss_bytes if st.proc else None,
            status=status, hang=st.hang, buckets=tuple(buckets), end_reason=st.end.reason if st.end else None,
        )

    def _rate(self) -> float | None:
        lead = max((st for st in self._ranks.values() if len(st.steps) >= 2), key=lambda st: st.steps[-1].step,
                   default=None)
        if lead is None:
            return None
        recent = list(lead.steps)[-20:]
        span_s = (recent[-1].t0_wall_ns - recent[0].t0_wall_ns) / 1e9
        return (recent[-1].step - recent[0].step) / span_s if span_s > 0 else None


def poll_source(live: LiveRun, source: RecordSource) -> tuple[LiveRun, list[RankRecord]]:
    """Poll ``source`` once and feed ``live``; returns the LiveRun to keep using, and the records.

    When the source moved on to another elastic attempt (torchrun restarted the workers), the
    records go to a fresh LiveRun: step numbers start over and the old attempt's ranks, history
    and findings must not mix with the new one's.
    """
    records = source.poll()
    if source.attempt != live.attempt:
        live = LiveRun(label=source.label, history=live.history, window=live.window, attempt=source.attempt)
    if records:
        live.feed(records)
    return live, records
