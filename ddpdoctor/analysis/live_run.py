"""Where the ranks' streams meet, live: the bounded state behind ``ddpdoctor watch``, fed from any record source.

``LiveRun.feed`` takes the records a :class:`~ddpdoctor.runlog.source.RecordSource` polled (a run
dir being written or a stream, the same here) and keeps only a sliding window of each rank's
recent steps, so memory stays flat over a run of any length. It completes steps (every rank
logged them: arrivals computed once), and runs the cross-rank detectors; their findings are
kept under a typed ``FindingKey``. ``LiveRun.snapshot`` projects that state into the frozen view
of ``live_view`` (rows, heatmap, step times, findings) for the UI, keeping each rank's row until
what it shows changes: at thousands of ranks most rows are the same from one snapshot to the next.

The cross-rank analysis is the same as the report's (a finding is defined once): clock offsets
from ``clock_align``, arrivals from ``bucket_wait``, blame and stragglers from ``blame`` and
``straggler`` over a sliding window of complete steps (the last ``window``, long enough to see a
period, and its last ``SHORT_WINDOW``, so a new steady straggler is named at once), lost ranks
from ``lost``, hangs from ``hang`` (with each rank's latest steps logged without any all-reduce,
which name a skipped backward), the bucket what-if from ``bucket_size``. No textual, no torch.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from statistics import median
from typing import Literal, NamedTuple, cast

from ddpdoctor.analysis import live_view
from ddpdoctor.analysis.blame import Margins, blame, step_margins
from ddpdoctor.analysis.bucket_size import RankBackward, bucket_size
from ddpdoctor.analysis.bucket_wait import StepArrivals
from ddpdoctor.analysis.clock_align import ClockOffsets
from ddpdoctor.analysis.collectives import StepCollectives, step_collectives, uneven_collectives
from ddpdoctor.analysis.findings import SEVERITY_ORDER, Finding, Severity
from ddpdoctor.analysis.groups import arrivals_in_groups, ddp_groups, group_clocks, merged_arrivals
from ddpdoctor.analysis.hang import hang_findings_in_groups
from ddpdoctor.analysis.live_view import EMPTY_HEALTH, LiveSnapshot, RankView, StepTime
from ddpdoctor.analysis.lost import GRACE_S, RankTail, lost_ranks
from ddpdoctor.analysis.nonfinite import CODE as NONFINITE
from ddpdoctor.analysis.nonfinite import finding_from_evidence, origin_of
from ddpdoctor.analysis.straggler import stragglers
from ddpdoctor.events import End, FindingRecord, Hang, Header, Layout, ProcSample, Step, Unused
from ddpdoctor.runlog.source import RankRecord, RecordSource, SourceHealth

#: Steps of history kept per rank (the table, heatmap and chart can be stepped back over these).
HISTORY = 200
#: Complete steps the live blame looks at: long enough to see a rank late every 8 or 16 steps (a
#: checkpoint or an evaluation on one rank) or on a third of the steps, as the report does over
#: the whole run. The ranks table's "cost to others" is each rank's time lost over these steps.
WINDOW = 64
#: ... and the same rule over the last this many of them: a steady straggler's cost reaches the
#: rule's share of the window's time within a few steps here, whatever the step time, so it is
#: named within ~``SHORT_WINDOW`` steps of starting (over 64 steps a 10%-late rank of a 1 s step
#: would need ~20).
SHORT_WINDOW = 10
#: The ranks of one job attach within the DDP constructor's collectives, so their headers' wall
#: times are close (clock skew between hosts included); one this much older than the last job's
#: first header seen is an earlier job's.
JOB_GAP_NS = 1_000_000_000
#: Steps the clock offsets are estimated from (the median is stable long before).
CLOCK_STEPS = 10
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


class FindingKey(NamedTuple):
    """Which live finding an entry is: a newer finding of the same key replaces the older one.

    ``origin`` "logged": a rank's own ``finding`` record (one entry per code, ranks united);
    "cross-rank": a detector run here over all ranks' records. A logged finding gives way to a
    cross-rank one of the same code (the cross-rank view knows more).
    """

    code: str
    origin: Literal["logged", "cross-rank"]
    ranks: tuple[int, ...] = ()
    severity: str = ""


def _logged(code: str) -> FindingKey:
    return FindingKey(code, "logged")


def _crossed(code: str, ranks: tuple[int, ...] = (), severity: str = "") -> FindingKey:
    return FindingKey(code, "cross-rank", ranks, severity)


class _Row(NamedTuple):
    """A rank's row as a snapshot last built it, and what from: kept while those stay the same."""

    version: int  # the rank's ``_RankState.version`` then
    step: Step | None
    arrivals: StepArrivals | None
    status: str
    lost_for_others_ms: float | None
    view: RankView


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
    bucket_params: dict[int, list[str]] = field(default_factory=dict)  # from the latest layout
    version: int = 0  # counts its records: a row built before the latest one is rebuilt
    row: _Row | None = None


def _latest(steps: deque[Step], n: int = BARE_STEPS) -> list[Step]:
    """The latest ``n`` steps (the ranks' collectives are compared over these, not the history)."""
    return list(itertools.islice(reversed(steps), n))


def _step_wall_ns(s: Step) -> int:
    return s.t0_wall_ns + int((s.end_us or s.sync_end_us or s.fwd_end_us or 0.0) * 1000)


class LiveRun:
    """Bounded live state of one run, fed record batches, read as immutable snapshots.

    Not thread-safe: one thread feeds and snapshots (the UI's watcher thread).
    """

    def __init__(
        self,
        label: str = "",
        history: int = HISTORY,
        window: int = WINDOW,
        attempt: int | None = None,
        ddp: int = 0,
    ) -> None:
        self.label = label
        self.attempt = attempt  # one elastic attempt per LiveRun: a restart starts a new one
        # where each process wrapped several DDP models (a GAN's two), the one followed: the
        # others' steps are their own and never mix with its (``load_run(ddp=K)`` alike)
        self.ddp = ddp
        self._models: set[int] = set()
        # jobs launched one after another into one run dir (``RankLog.earlier_jobs``): the view
        # follows the last; the ranks whose latest header is an earlier job's are left out
        self.earlier_jobs = 0
        self._job_began: int | None = None  # wall ns of the last job's first header seen
        self._earlier_job_ranks: set[int] = set()
        self.history = max(history, SHORT_WINDOW + 1)
        self.window = min(window, self.history - 1)  # the blame reads only steps still kept
        self._source = EMPTY_HEALTH
        self._records = 0
        self._clear_job()

    def _clear_job(self) -> None:
        """The state of the job followed: its ranks, steps, blame and findings (none yet)."""
        self._ranks: dict[int, _RankState] = {}
        self._world_size = 0
        self._pending: dict[int, set[int]] = {}  # step -> ranks that logged it, until complete
        self._complete: deque[int] = deque(maxlen=self.history)
        # the DDP groups (``groups.ddp_groups``), recomputed only when a header or a rank comes:
        # never per record
        self._groups: list[list[int]] = []
        self._groups_stale = False
        # per complete step, per DDP group (by its lowest rank): its arrivals, who held the others
        # of the group and by how much, and the group's median step (ms). Ranks of different
        # groups never wait for each other: arrivals, clocks and blame stay within a group
        self._arrivals: dict[int, dict[int, StepArrivals]] = {}
        # per step, the groups' arrivals merged and drawn as a heatmap: the same for every snapshot
        # that shows that step, so built once (a step's arrivals never change once it is complete)
        self._merged: dict[int, StepArrivals | None] = {}
        self._heatmaps: dict[int, live_view.Heatmap] = {}
        self._margins: dict[int, dict[int, Margins]] = {}
        self._group_ms: dict[int, dict[int, float]] = {}
        self._step_times: deque[StepTime] = deque(maxlen=self.history)
        self._clocks: ClockOffsets | None = None
        self._clock_age = 0
        self._findings: dict[FindingKey, Finding] = {}  # in order of first appearance
        self._nonfinite: dict[int, Finding] = {}  # rank -> its first non-finite step (logged)
        self._stragglers: set[int] = set()
        self._lost_for_others: dict[int, float] = {}  # rank -> ms the others lost for it, over the window
        self._lost: set[int] = set()  # ranks lost, as of the last feed
        self._hung: set[int] = set()  # ranks waiting in a hang, as of the last feed
        self._collectives_seen = -1  # the records count when the collectives were last compared
        # each step's collectives as the first rank of its DDP group to log it ran them (group lead
        # -> step -> collectives), the steps where a later rank's differed, and the step records
        # not looked at yet: the full comparison runs only once some step differs
        self._lead: dict[int, int] = {}
        self._first_collectives: dict[int, dict[int, StepCollectives]] = {}
        self._uneven_steps: set[tuple[int, int]] = set()
        self._unchecked_steps: list[tuple[int, Step]] = []
        self._recheck_collectives = True  # the groups changed, or a rank started over: look at all
        # each rank's ``RankTail`` (the lost check's input), rebuilt only for ranks that logged since
        self._tails: dict[int, RankTail] = {}
        self._tail_ns: dict[int, int] = {}  # (ranks whose tail has a wall time)
        self._stale_tails: set[int] = set()
        self._checked_upto: int | None = None
        self._whatif_at: int | None = None  # complete step of the last bucket what-if
        self._whatif_final = False

    # -- feeding ------------------------------------------------------------------------------

    def feed(self, records: Iterable[RankRecord]) -> None:
        """Take a batch of records (any ranks, arrival order per rank)."""
        followed, models = self.ddp, self._models
        for rr in records:
            if rr.ddp != followed:
                models.add(rr.ddp)  # another DDP model in the processes: said, not mixed in
                continue
            if isinstance(rr.record, Header):
                if not self._take_job(rr.rank, rr.record):
                    continue
            elif self._earlier_job_ranks and rr.rank in self._earlier_job_ranks:
                continue  # an earlier job's record (the file is read from its start)
            self._records += 1
            self._add(rr.rank, rr.record)
        self._check_stragglers()
        self._check_bucket_size()
        self._lost = self._check_lost()
        self._unname_lost()
        self._hung = self._check_hangs()
        self._check_collectives()

    def set_source_health(self, health: SourceHealth) -> None:
        self._source = health

    def _state(self, rank: int) -> _RankState:
        st = self._ranks.get(rank)
        if st is None:
            st = self._ranks[rank] = _RankState(rank, steps=deque(maxlen=self.history))
            self._groups_stale = True
        return st

    def _ddp_groups(self) -> list[list[int]]:
        """The ranks of each DDP group, as of the latest header (recomputed only after one came)."""
        if self._groups_stale:
            groups = ddp_groups({r: st.header for r, st in self._ranks.items()})
            if groups != self._groups:
                self._clocks = None  # each group's clocks are aligned within it
                self._lead = {r: members[0] for members in groups for r in members}
                self._recheck_collectives = True
            self._groups, self._groups_stale = groups, False
        return self._groups

    def _add(self, rank: int, rec: object) -> None:
        st = self._state(rank)
        st.version += 1
        self._stale_tails.add(rank)
        if isinstance(rec, Step):
            if st.steps and rec.step <= st.steps[-1].step:
                return  # read again (a file replaced under us) or out of order: already counted
            st.steps.append(rec)
            self._unchecked_steps.append((rank, rec))
            if not rec.bucket_count():
                st.bare.append(rec.step)
            st.last_wall_ns = max(st.last_wall_ns, _step_wall_ns(rec))
            if st.hang is not None and st.hang.state == "stalled" and rec.step >= st.hang.step:
                st.hang = None  # progress came back
            self._step_logged(rank, rec.step)
        elif isinstance(rec, ProcSample):
            st.proc = rec
            st.last_wall_ns = max(st.last_wall_ns, rec.t_wall_ns)
        elif isinstance(rec, Header):
            st.header = rec  # (a header that starts over was taken by ``_take_job`` first)
            self._groups_stale = True
            # DDP over a subgroup: the header's world size is its group's; the run has more ranks
            self._world_size = max(self._world_size, rec.whole_world_size())
            st.last_wall_ns = max(st.last_wall_ns, rec.t_wall_ns)
        elif isinstance(rec, Layout):
            st.buckets = len(rec.buckets)
            st.bucket_params = {b.index: b.params for b in rec.buckets}
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
            if rec.code == NONFINITE:  # each rank's first non-finite step: the origin across ranks
                f = finding_from_evidence(rank, rec.step, rec.evidence)
                if rank not in self._nonfinite:
                    self._nonfinite[rank] = f
                    verdict = origin_of(self._nonfinite, self._world_size)
                    if verdict is not None:
                        self._findings[_crossed(NONFINITE)] = verdict
            key = _logged(rec.code)
            old = self._findings.get(key)
            ranks = sorted(set(old.ranks if old else []) | set(rec.ranks or [rank]))
            if old is None:
                # the runtime writes one of the three severities; an unknown one reads as info
                severity = cast(Severity, rec.severity if rec.severity in SEVERITY_ORDER else "info")
                self._findings[key] = Finding(
                    code=rec.code,
                    severity=severity,
                    title=rec.title,
                    detail=rec.detail,
                    fix=rec.fix,
                    ranks=ranks,
                    step=rec.step,
                    evidence=dict(rec.evidence),
                )
            elif ranks != old.ranks:
                self._findings[key] = dataclasses.replace(old, ranks=ranks)

    def _take_job(self, rank: int, header: Header) -> bool:
        """Whether ``header`` belongs to the job followed. An attach header on a rank that
        already logged starts over: from another process it is a later job launched into the same
        run dir, and the whole view starts over on it (as on a new elastic attempt); from the same
        process, the file was replaced, and that rank starts over. A header from before the last
        job began is an earlier job's: that rank's records are skipped until a header of the last
        job comes."""
        began = self._job_began
        if began is not None and header.t_wall_ns < began - JOB_GAP_NS:
            self._earlier_job_ranks.add(rank)
            return False
        st = self._ranks.get(rank)
        if st is not None and st.header is not None and header.reason == "attach" and (st.steps or st.end):
            if header.pid != st.header.pid:
                self._start_over(header.t_wall_ns)
            else:
                self._reset_rank(rank)  # the file was replaced: a new run under the same name
        self._earlier_job_ranks.discard(rank)
        return True

    def _start_over(self, began: int) -> None:
        """A later job began (``_take_job``): every rank, step and finding of the earlier one goes;
        its ranks' records are skipped until their last job's header comes."""
        self._earlier_job_ranks |= set(self._ranks)
        self._clear_job()
        self.earlier_jobs += 1
        self._job_began = began

    def _reset_rank(self, rank: int) -> None:
        del self._ranks[rank]
        self._groups_stale = True
        self._forget_views()
        self._recheck_collectives = True
        self._tails.pop(rank, None)
        self._tail_ns.pop(rank, None)
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

    def _merged_arrivals(self, step: int) -> StepArrivals | None:
        """Every group's arrivals at ``step`` in one: each rank's lateness stays that within its
        own group."""
        if step not in self._merged:
            if len(self._merged) > 2 * self.history:
                self._forget_views()
            self._merged[step] = merged_arrivals(list(self._arrivals.get(step, {}).values()))
        return self._merged[step]

    def _heatmap(self, arr: StepArrivals) -> live_view.Heatmap:
        heat = self._heatmaps.get(arr.step)
        if heat is None:
            has_bcast = any(s.bcast_start_us is not None for s in self._steps_at(arr.step).values())
            heat = self._heatmaps[arr.step] = live_view.heatmap(arr, has_bcast)
        return heat

    def _forget_views(self, step: int | None = None) -> None:
        """Drop what ``_merged_arrivals`` and ``_heatmap`` built, of one step or of all."""
        if step is None:
            self._merged.clear()
            self._heatmaps.clear()
        else:
            self._merged.pop(step, None)
            self._heatmaps.pop(step, None)

    @staticmethod
    def _followed(st: _RankState) -> Step | None:
        """The step a rank's row shows when following: its own latest, or once the rank has
        ended, its latest with a duration (the last step's end would have come from a forward
        that never ran, and a row reads one step's figures, not two steps' mixed)."""
        if not st.steps:
            return None
        last = st.steps[-1]
        if last.end_us is None and st.end is not None and len(st.steps) > 1 and st.steps[-2].end_us is not None:
            return st.steps[-2]
        return last

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
        groups = self._ddp_groups()
        if (
            self._clocks is None
            or self._clock_age >= CLOCK_EVERY
            or any(r not in self._clocks.offset_us for r in by_rank)
        ):
            recent = {r: list(st.steps)[-CLOCK_STEPS:] for r, st in self._ranks.items()}
            self._clocks, self._clock_age = group_clocks(recent, groups), 0
        self._clock_age += 1
        found = arrivals_in_groups({r: [s] for r, s in by_rank.items()}, groups, self._clocks)
        ends = [s.end_us / 1000.0 for s in by_rank.values() if s.end_us is not None]
        if ends:
            self._step_times.append(StepTime(step, min(ends), median(ends), max(ends)))
        at_step: dict[int, StepArrivals] = {}
        margins: dict[int, Margins] = {}
        group_ms: dict[int, float] = {}
        for members, arrived in zip(groups, found, strict=True):
            if arrived:
                at_step[members[0]] = arrived[0]
                margins[members[0]] = step_margins(arrived[0])
            if len(groups) == 1:
                if ends:
                    group_ms[members[0]] = self._step_times[-1].median_ms
                continue
            mine = [end for r in members if r in by_rank and (end := by_rank[r].end_us) is not None]
            if mine:
                group_ms[members[0]] = median(mine) / 1000.0
        if at_step:
            self._arrivals[step], self._margins[step] = at_step, margins
        self._group_ms[step] = group_ms
        self._forget_views(step)  # a finished rank's row may have asked for it before it completed
        if len(self._complete) == self._complete.maxlen:
            self._arrivals.pop(self._complete[0], None)
            self._margins.pop(self._complete[0], None)
            self._group_ms.pop(self._complete[0], None)
            self._forget_views(self._complete[0])
        self._complete.append(step)

    # -- cross-rank live findings ---------------------------------------------------------------

    def _check_stragglers(self) -> None:
        """Blame over the window; stragglers are the ranks the rule names over it or over its last
        ``SHORT_WINDOW`` steps (the finding from the longer window when both do: it sees the pattern)."""
        if not self._complete or self._complete[-1] == self._checked_upto or len(self._ranks) < 2:
            return
        # the check costs O(ranks x window): on large runs, every other step (still named within the window)
        if (
            len(self._ranks) >= LARGE_RUN
            and self._checked_upto is not None
            and self._complete[-1] < self._checked_upto + 2
        ):
            return
        self._checked_upto = self._complete[-1]
        complete = list(self._complete)[-self.window :]
        found: dict[int, Finding] = {}
        lost_for_others: dict[int, float] = {}
        for members in self._ddp_groups():  # each group's ranks wait only for each other
            if len(members) >= 2:
                found.update(self._group_stragglers(members, complete, lost_for_others))
        if not lost_for_others:  # too few complete steps yet: keep what the last check said
            return
        self._lost_for_others = lost_for_others
        found = {rank: f for rank, f in found.items() if rank not in self._lost}  # (``_unname_lost``)
        self._stragglers = set(found)
        for rank, f in found.items():
            key = _crossed("straggler", (rank,))
            old = self._findings.get(key)
            seen = old.evidence["live_seen_at_step"] if old else self._checked_upto
            self._findings[key] = dataclasses.replace(
                f, step=old.step if old else f.step, evidence={**f.evidence, "live_seen_at_step": seen}
            )

    def _group_stragglers(
        self, members: list[int], complete: list[int], lost_for_others: dict[int, float]
    ) -> dict[int, Finding]:
        """One DDP group's stragglers over the ``complete`` steps (rank -> finding); each member's
        cost to the others of its group goes into ``lost_for_others``."""
        lead = members[0]
        recent = [s for s in complete if lead in self._arrivals.get(s, ())]
        if len(recent) < 3:
            return {}
        wanted = set(recent) | {s - 1 for s in recent}  # the step before: the data-loading gap
        tail = self.window + 2
        steps_by_rank = {
            r: [s for s in list(islice(reversed(self._ranks[r].steps), tail))[::-1] if s.step in wanted]
            for r in members
            if r in self._ranks
        }
        window = [self._arrivals[s][lead] for s in recent]
        margins = {s: self._margins[s][lead] for s in recent}
        durations = {s: ms[lead] for s in recent if lead in (ms := self._group_ms.get(s, {}))}  # as blame.step_ms_of
        whole = blame(steps_by_rank, window, durations, margins)
        found = {f.ranks[0]: f for f in stragglers(steps_by_rank, window, whole)}
        short = window[-SHORT_WINDOW:]
        if len(short) < len(window):
            recent_blame = blame(steps_by_rank, short, durations, margins)
            if any(rb.rank not in found for rb in recent_blame.named()):  # else: no finding to build
                for f in stragglers(steps_by_rank, short, recent_blame):
                    found.setdefault(f.ranks[0], f)
        lost_for_others.update({r: rb.lost_ms for r, rb in whole.ranks.items()})
        return found

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
        ranks = {
            rank: RankBackward(
                header=self._ranks[rank].header,
                steps=list(self._ranks[rank].steps),
                unused=list(self._ranks[rank].sampled),
            )
            for rank in sorted(self._ranks)[:WHATIF_RANKS]
        }
        try:
            found = bucket_size(ranks)
        except (ValueError, ZeroDivisionError, KeyError):  # a window too thin to replay: try again later
            return
        self._findings.pop(_crossed("bucket-size"), None)
        for f in found:
            self._findings[_crossed("bucket-size")] = f

    def _check_lost(self) -> set[int]:
        """Ranks whose log stopped while others went on (their finding is kept once seen)."""
        for rank in self._stale_tails:
            st = self._ranks.get(rank)
            if st is not None:
                tail = RankTail(
                    header=st.header, last_step=st.steps[-1] if st.steps else None, last_proc=st.proc, end=st.end
                )
                self._tails[rank] = tail
                if (t := tail.last_wall_ns) is not None:
                    self._tail_ns[rank] = t
                else:
                    self._tail_ns.pop(rank, None)
        self._stale_tails.clear()
        if len(self._ranks) < 2:
            return set()
        times = self._tail_ns.values()
        # none closed its log, every one logged, all within the grace: ``lost_ranks`` names none
        if len(times) == len(self._tails) and max(times) - min(times) < GRACE_S * 1e9 and not self._any_ended():
            return set()
        found = lost_ranks(self._tails)
        for f in found:
            self._findings.setdefault(_crossed("rank-lost", (f.ranks[0],)), f)
        return {r for f in found for r in f.ranks}

    def _unname_lost(self) -> None:
        """A lost rank is no straggler: the others waited for it because it died (its last step's
        collectives never came), which ``rank-lost`` says; a straggler finding would send the
        reader after its speed."""
        for rank in self._lost & self._stragglers:
            self._findings.pop(_crossed("straggler", (rank,)), None)
        self._stragglers -= self._lost

    def _any_ended(self) -> bool:
        return any(tail.end is not None for tail in self._tails.values())

    def _check_collectives(self) -> None:
        """``mismatched-collectives`` once the ranks' steps ran different collectives (kept once seen).

        Each new step record is held against the first one of its step in its DDP group; the
        ranks' latest steps are compared in full (``uneven_collectives``) only while some step
        differs, so a healthy run costs one look per record, not one per rank and step per feed.
        """
        if self._collectives_seen == self._records or any(k.code == "mismatched-collectives" for k in self._findings):
            self._unchecked_steps.clear()
            return
        self._collectives_seen = self._records
        groups = self._ddp_groups()
        fresh, self._unchecked_steps = self._unchecked_steps, []
        if self._recheck_collectives:
            self._recheck_collectives = False
            self._first_collectives.clear()
            self._uneven_steps.clear()
            fresh = [(r, s) for r, st in self._ranks.items() for s in reversed(_latest(st.steps))]
        for rank, s in fresh:
            lead = self._lead.get(rank)
            if lead is None:  # in no group yet (no header): the full comparison leaves it out too
                continue
            ran = step_collectives((s,))[s.step]
            firsts = self._first_collectives.setdefault(lead, {})
            if firsts.setdefault(s.step, ran) != ran:
                self._uneven_steps.add((lead, s.step))
            if len(firsts) > 2 * self.history:
                horizon = self._collectives_horizon(lead)
                for step in [k for k in firsts if k < horizon]:
                    del firsts[step]
        if not self._uneven_steps:
            return
        for members in groups:
            steps = {r: step_collectives(_latest(self._ranks[r].steps)) for r in members if r in self._ranks}
            for f in uneven_collectives(steps):
                self._findings.setdefault(_crossed("mismatched-collectives", tuple(members)), f)
        # a step some rank of the group no longer holds among its latest can never be compared again
        self._uneven_steps = {(lead, k) for lead, k in self._uneven_steps if k >= self._collectives_horizon(lead)}

    def _collectives_horizon(self, lead: int) -> int:
        """The oldest step that can still be among every rank's latest of ``lead``'s group."""
        members = next((g for g in self._groups if g[0] == lead), [lead])
        return max(
            (
                self._ranks[r].steps[-BARE_STEPS].step
                for r in members
                if r in self._ranks and len(self._ranks[r].steps) >= BARE_STEPS
            ),
            default=-1,
        )

    def _check_hangs(self) -> set[int]:
        """Ranks that are part of a hang now (waiting in a collective that cannot complete)."""
        latest = {r: st.last_hang for r, st in self._ranks.items() if st.last_hang is not None}
        stalled = {r for r, st in self._ranks.items() if st.hang is not None and st.end is None}
        if not latest:
            return set()
        last = {r: (st.steps[-1].step if st.steps else None) for r, st in self._ranks.items()}
        ended = {r: st.end.reason for r, st in self._ranks.items() if st.end is not None}
        current = {r: h for r, h in latest.items() if r in stalled or h.state == "resumed"}
        try:
            bare = {r: list(st.bare) for r, st in self._ranks.items() if st.bare}  # names a skipped backward
            found = hang_findings_in_groups(
                current,
                last,
                self._expected(),
                self._ddp_groups(),
                ended=ended,
                bare_steps=bare,
                history=latest,
                collectives={r: step_collectives(_latest(st.steps)) for r, st in self._ranks.items()},
                bucket_params={r: st.bucket_params for r, st in self._ranks.items()},
            )
        except Exception:  # noqa: BLE001 - the live view must not die of one detector's bug
            return self._hung
        # the hang as seen now replaces the hang as seen before: the ranks' watchdogs fire one
        # after another, and the first one alone names the wrong rank (rank 1, ahead in a later
        # collective, reports first: rank 0 looks missing). A resumed stall ("info") is history
        # and stays
        now = {_crossed("hang", tuple(f.ranks), f.severity): f for f in found}
        for key in [k for k in self._findings if k.code == "hang" and k.origin == "cross-rank"]:
            if key.severity != "info" and key not in now:
                del self._findings[key]
        hung = False
        for key, f in now.items():
            self._findings[key] = f  # an entry kept keeps its place in the list
            hung = hung or f.severity == "error"
        # in a hang every stalled rank is hung, as the report says; the finding names the
        # missing rank and where it is
        return stalled if hung else set()

    # -- reading --------------------------------------------------------------------------------

    def snapshot(self, at_step: int | None = None) -> LiveSnapshot:
        """The view at ``at_step`` (a complete step), or at the latest complete step when None.

        It changes no finding or status (the detectors ran in ``feed``); what it keeps, each
        rank's row and each step's merged arrivals and heatmap, is rebuilt where it changed.
        """
        complete = tuple(self._complete)
        if at_step is not None and complete:
            at_step = min(max(at_step, complete[0]), complete[-1])
        view = at_step if at_step is not None else (complete[-1] if complete else None)
        arr = self._merged_arrivals(view) if view is not None else None
        # a finished rank's row (following) may show the step before the view: its own arrivals
        at: dict[int | None, StepArrivals | None] = {view: arr}
        rows = []
        for rank in sorted(self._ranks):
            st = self._ranks[rank]
            s = self._followed(st) if at_step is None else self._find(st, at_step)
            row_arr = arr
            if s is not None and s.step != view and at_step is None and st.end is not None:
                if s.step not in at:
                    at[s.step] = self._merged_arrivals(s.step)
                row_arr = at[s.step]
            status = live_view.rank_status(
                rank, st.end, st.hang is not None, lost=self._lost, hung=self._hung, stragglers=self._stragglers
            )
            lost_ms = self._lost_for_others.get(rank)
            old = st.row
            if (
                old is not None
                and old.version == st.version
                and old.step is s
                and old.arrivals is row_arr
                and old.status == status
                and old.lost_for_others_ms == lost_ms
            ):
                rows.append(old.view)  # most ranks logged nothing since the last snapshot
                continue
            lat = (
                row_arr.lateness_us.get(rank) if row_arr is not None and (s is None or s.step == row_arr.step) else None
            )
            row = live_view.rank_row(
                rank,
                header=st.header,
                step=s,
                proc=st.proc,
                end=st.end,
                hang=st.hang,
                status=status,
                arrivals=row_arr,
                lateness=lat,
                lost_for_others_ms=lost_ms,
            )
            st.row = _Row(st.version, s, row_arr, status, lost_ms, row)
            rows.append(row)
        heat = self._heatmap(arr) if arr is not None else None
        headers = [st.header for st in self._ranks.values() if st.header is not None]
        h0 = min(headers, key=lambda h: h.rank) if headers else None
        findings = self._shown_findings()
        latest = max((st.steps[-1].step for st in self._ranks.values() if st.steps), default=None)
        groups = self._ddp_groups()
        return LiveSnapshot(
            label=self.label,
            run_id=h0.run_id if h0 else "",
            world_size=self._expected(),
            ddp_groups=tuple(tuple(g) for g in groups) if len(groups) > 1 else (),
            backend=h0.backend if h0 else "",
            device=h0.device if h0 else "",
            ranks=tuple(rows),
            steps=complete,
            view_step=view,
            latest_step=latest,
            heatmap=heat,
            step_times=tuple(self._step_times),
            findings=findings,
            health=live_view.run_health(rows, findings),
            steps_per_s=self._rate(),
            finished=bool(self._ranks)
            and all(st.end is not None for st in self._ranks.values())
            and len(self._ranks) >= self._world_size,
            source=self._source,
            records=self._records,
            attempt=self.attempt,
            ddp=self.ddp,
            ddp_models=tuple(sorted(self._models | {self.ddp})),
            earlier_jobs=self.earlier_jobs,
        )

    def _shown_findings(self) -> tuple[Finding, ...]:
        """The findings in order of first appearance; a rank's own finding gives way to the
        cross-rank one of the same code (its watchdog's hang, against the hang across ranks)."""
        crossed = {key.code for key in self._findings if key.origin == "cross-rank"}
        return tuple(f for key, f in self._findings.items() if not (key.origin == "logged" and key.code in crossed))

    def _rate(self) -> float | None:
        lead = max(
            (st for st in self._ranks.values() if len(st.steps) >= 2), key=lambda st: st.steps[-1].step, default=None
        )
        if lead is None:
            return None
        recent = list(lead.steps)[-20:]
        span_s = (recent[-1].t0_wall_ns - recent[0].t0_wall_ns) / 1e9
        return (recent[-1].step - recent[0].step) / span_s if span_s > 0 else None


def poll_source(live: LiveRun, source: RecordSource) -> tuple[LiveRun, list[RankRecord]]:
    """Poll ``source`` once and feed ``live``; returns the LiveRun to keep using, and the records.

    When the source moved on to another elastic attempt (torchrun restarted the workers) or
    another run (its label names what it follows), the records go to a fresh LiveRun: step
    numbers start over and the old attempt's or run's ranks, history and findings must not mix
    with the new one's.
    """
    records = source.poll()
    if source.attempt != live.attempt or source.label != live.label:
        live = LiveRun(
            label=source.label, history=live.history, window=live.window, attempt=source.attempt, ddp=live.ddp
        )
    if records:
        live.feed(records)
    return live, records
