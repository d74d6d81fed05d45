"""What the live view draws: frozen snapshot dataclasses, and the rows and heatmap built from live state.

``live_run.LiveRun`` (the state: ingestion, step completion, detectors) builds one
``LiveSnapshot`` per tick with the functions here; the widgets in ``ddpdoctor_tui`` read only
these dataclasses. Nothing here keeps state or analyses: a row is a projection of one rank's
latest records, the heatmap one of a step's arrivals. No textual, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from statistics import median

from ddpdoctor.analysis.blame import Outlier, by_host, fold_into_hosts, out_of_line
from ddpdoctor.analysis.bucket_wait import StepArrivals
from ddpdoctor.analysis.findings import SEVERITY_ORDER, Finding
from ddpdoctor.events import End, Hang, Header, ProcSample, Step
from ddpdoctor.runlog.source import SourceHealth

#: Every rank status, from the quiet to the loud (the table colours them).
STATUSES = ("running", "straggler", "stalled", "hung", "finished", "terminated", "failed", "lost")

EMPTY_HEALTH = SourceHealth(0, 0, 0)


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
    end_reason: str | None = None  # ``end_text`` of its end record
    #: wall ms the run lost waiting for this rank over the live blame window (the last 64 complete
    #: steps as of the latest check, as the status): the sum of its margins over the runner-up
    #: above the noise floor (``analysis/blame.py``). None: not computed yet (fewer than 3 complete steps, one rank)
    lost_for_others_ms: float | None = None
    #: the step record and lateness ``buckets`` is built from: on first use only, as one rank's
    #: detail (or a scrape) reads them, never for every row of every snapshot
    step_record: Step | None = field(default=None, repr=False, compare=False)
    step_lateness: Sequence[float] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def buckets(self) -> tuple[BucketView, ...]:
        """The rank's collectives at its step (``bucket_views``); empty where it logged none."""
        return bucket_views(self.step_record, self.step_lateness) if self.step_record is not None else ()


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
    #: the ranks of each DDP group where DDP runs over subgroups of the world (``groups.ddp_groups``);
    #: empty for one group. Lateness, waits and blame are each rank's within its group
    ddp_groups: tuple[tuple[int, ...], ...] = ()
    #: the DDP model shown (``--ddp``) where each process wrapped several, and the models whose
    #: records the source held so far (``(0,)``: one model, the usual case)
    ddp: int = 0
    ddp_models: tuple[int, ...] = (0,)
    #: jobs launched into the same run dir before the one shown (left out of the view)
    earlier_jobs: int = 0


def _ms(v: float | None) -> float | None:
    return None if v is None else v / 1000.0


def end_status(end: End) -> str:
    """How a rank's log ended: failed (an exception ended training), terminated (a signal killed
    the process, or a stop signal came and the job's own handler ended it: a preemption), or
    finished."""
    if end.reason.startswith("error"):
        return "failed"
    return "terminated" if end.reason == "signal" or end.signal else "finished"


def end_text(end: End) -> str:
    """The end record in a few words: its reason, with the stop signal that came before it
    (``signal: SIGTERM``, ``exit after SIGTERM``)."""
    if not end.signal:
        return end.reason
    return f"signal: {end.signal}" if end.reason == "signal" else f"{end.reason} after {end.signal}"


def rank_status(
    rank: int, end: End | None, stalled: bool, *, lost: set[int], hung: set[int], stragglers: set[int]
) -> str:
    """One of ``STATUSES``: the end record first, then lost, hung, stalled (its watchdog fired), straggler."""
    if end is not None:
        return end_status(end)
    if rank in lost:
        return "lost"
    if rank in hung:
        return "hung"
    if stalled:
        return "stalled"
    return "straggler" if rank in stragglers else "running"


def bucket_views(s: Step, lateness: Sequence[float] | None) -> tuple[BucketView, ...]:
    """The step's collectives of one rank: the buffer broadcast (if any), then each bucket."""
    out: list[BucketView] = []
    has_bcast = s.bcast_start_us is not None
    if has_bcast:
        start = s.bcast_start_us or 0.0
        out.append(
            BucketView(
                "bcast",
                _ms(start),
                _ms(start + (s.bcast_us or 0.0)),
                s.bcast_bytes,
                lateness[0] / 1000.0 if lateness else None,
            )
        )
    off = 1 if has_bcast else 0
    span = None if s.per_bucket() else s.ready_span_us()
    if span is not None:  # a window row (or a CUDA step between samples): first and last bucket, sync end
        for i, (name, at, end) in enumerate((("first", span[0], None), ("last", span[1], s.sync_end_us))):
            late = lateness[i + off] / 1000.0 if lateness and i + off < len(lateness) else None
            out.append(BucketView(name, _ms(at), _ms(end), 0, late))
        return tuple(out)
    for i, ready in enumerate(s.b_ready_us):
        done = s.b_done_us[i] if i < len(s.b_done_us) else None
        nbytes = s.b_bytes[i] if i < len(s.b_bytes) else 0
        late = lateness[i + off] / 1000.0 if lateness and i + off < len(lateness) else None
        out.append(BucketView(f"b{i}", _ms(ready), _ms(done), nbytes, late))
    return tuple(out)


def rank_row(
    rank: int,
    *,
    header: Header | None,
    step: Step | None,
    proc: ProcSample | None,
    end: End | None,
    hang: Hang | None,
    status: str,
    arrivals: StepArrivals | None,
    lateness: Sequence[float] | None,
    lost_for_others_ms: float | None = None,
) -> RankView:
    """The ranks table's row of one rank at one step (``step`` None: it has logged none there);
    ``lost_for_others_ms``: what it cost the others over the live window (from the blame)."""
    s = step
    bwd = (
        s.bwd_end_us - s.fwd_end_us if s is not None and s.bwd_end_us is not None and s.fwd_end_us is not None else None
    )
    wait = arrivals.wait_us.get(rank) if arrivals is not None and lateness is not None else None
    return RankView(
        rank=rank,
        host=header.host if header else "",
        step=s.step if s else None,
        step_ms=_ms(s.end_us) if s else None,
        fwd_ms=_ms(s.fwd_us) if s else None,
        bwd_ms=_ms(bwd),
        wait_ms=_ms(wait),
        bcast_ms=_ms(s.bcast_us) if s else None,
        late_ms=max(lateness) / 1000.0 if lateness else None,
        cpu_pct=proc.cpu_pct if proc else None,
        rss_bytes=proc.rss_bytes if proc else None,
        status=status,
        hang=hang,
        end_reason=end_text(end) if end else None,
        lost_for_others_ms=lost_for_others_ms,
        step_record=s,
        step_lateness=lateness,
    )


def heatmap(arrivals: StepArrivals, has_bcast: bool) -> Heatmap:
    """The step's arrivals as a ranks x collectives grid of ms late (each rank's row as long as its
    collectives: DDP groups that train different models have different buckets)."""
    n = max((len(v) for v in arrivals.lateness_us.values()), default=0)
    buckets = [f"b{i}" for i in range(n - (1 if has_bcast else 0))] if arrivals.per_bucket else ["first", "last"]
    names = (["bcast"] if has_bcast else []) + buckets
    return Heatmap(
        step=arrivals.step,
        collectives=tuple(names),
        late_ms={r: tuple(v / 1000.0 for v in lat) for r, lat in sorted(arrivals.lateness_us.items())},
    )


def run_health(rows: Sequence[RankView], findings: Iterable[Finding]) -> str:
    """``waiting`` (no rank yet), ``ok``, ``warning`` or ``error``: the worst finding or rank status."""
    if not rows:
        return "waiting"
    statuses = {r.status for r in rows}
    worst = max((SEVERITY_ORDER[f.severity] for f in findings), default=-1)
    if worst >= 2 or statuses & {"hung", "lost", "failed"}:
        return "error"
    if worst >= 1 or statuses & {"straggler", "stalled", "terminated"}:
        return "warning"
    return "ok"


#: Up to this many hosts are named one by one; above, in ranges of numbered names.
LISTED_HOSTS = 3
#: At most this many ranges of host names, then how many more.
HOST_RANGES = 6


def hosts_text(hosts: Iterable[str]) -> str:
    """The hosts in a few words: "node000, node001", or "32 hosts: node000–node031" (names that
    end in a number, in ranges of consecutive numbers), the report's header and the live view's."""
    names = sorted(set(hosts))
    if len(names) <= LISTED_HOSTS:
        return ", ".join(names)
    numbered: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    for name in names:
        m = re.fullmatch(r"(.*?)(\d+)", name)
        if m is None:
            plain.append(name)
        else:
            numbered.setdefault((m.group(1), len(m.group(2))), []).append(int(m.group(2)))
    parts: list[str] = []
    for (prefix, width), numbers in sorted(numbered.items()):
        numbers.sort()
        start = prev = numbers[0]
        for n in [*numbers[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            first, last = f"{prefix}{start:0{width}d}", f"{prefix}{prev:0{width}d}"
            parts.append(first if start == prev else f"{first}{'–' if prev > start + 1 else ', '}{last}")
            if n is not None:
                start = prev = n
    parts += plain
    more = f", ... ({len(parts) - HOST_RANGES} more ranges)" if len(parts) > HOST_RANGES else ""
    return f"{len(names)} hosts: {', '.join(parts[:HOST_RANGES])}{more}"


#: Above this many ranks the live view leads with the worst ranks: its table sorted by what each
#: rank cost the others, the rank detail following the worst, the heatmap's latest and slowest
#: first (up to it, ranks in rank order, as the report shows every rank's row).
AT_SCALE = 16


def judged_values(r: RankView) -> dict[str, float | None]:
    """A row's numbers as ``blame.out_of_line`` judges them (the report's, at the viewed step)."""
    return {"late": r.late_ms, "step": r.step_ms, "forward": r.fwd_ms, "backward": r.bwd_ms}


@dataclass(frozen=True)
class OutOfLine:
    """The live view's ranks and hosts out of line (``blame.out_of_line``, as the report judges):
    ``ranks`` worst first, less those listed with their host; ``hosts``; ``order``: every rank
    out of line (host's ones too), worst first."""

    ranks: tuple[Outlier, ...]
    hosts: tuple[Outlier, ...]
    order: tuple[int, ...]
    within: int  # ranks not out of line


def live_out_of_line(rows: Sequence[RankView]) -> OutOfLine:
    """Judge the rows at the viewed step: lateness, step, forward, backward against the others'
    spread, the blame's stragglers, lost, hung, failed or stalled ranks, ranks that ended early."""
    values = {r.rank: judged_values(r) for r in rows}
    hosts = {r.rank: r.host for r in rows if r.host}
    ranks = out_of_line(
        values,
        cost_ms={r.rank: r.lost_for_others_ms for r in rows},
        named={r.rank for r in rows if r.status == "straggler"},
        statuses={r.rank: r.status for r in rows},
        steps={r.rank: r.step + 1 if r.step is not None else None for r in rows},
    )
    host_values = by_host(values, hosts)
    host_out = out_of_line(host_values) if len(host_values) >= 2 else []
    return OutOfLine(
        ranks=tuple(fold_into_hosts(ranks, host_out, hosts)),
        hosts=tuple(host_out),
        order=tuple(int(o.key) for o in ranks),
        within=len(rows) - len(ranks),
    )


def node_rows(rows: Sequence[RankView]) -> list[RankView]:
    """One row per host: the medians of its ranks' numbers, the sum of what they cost the others,
    the loudest status; ``rank`` is its lowest rank (the row's ranks: ``host_ranks``)."""
    members: dict[str, list[RankView]] = {}
    for r in rows:
        members.setdefault(r.host or "?", []).append(r)

    def mid(values: Iterable[float | None]) -> float | None:
        have = [v for v in values if v is not None]
        return median(have) if have else None

    out = []
    for host, views in members.items():
        steps = [v.step for v in views if v.step is not None]
        costs = [v.lost_for_others_ms for v in views if v.lost_for_others_ms is not None]
        rss = [v.rss_bytes for v in views if v.rss_bytes is not None]
        out.append(
            RankView(
                rank=min(v.rank for v in views),
                host=host,
                step=max(steps) if steps else None,
                step_ms=mid(v.step_ms for v in views),
                fwd_ms=mid(v.fwd_ms for v in views),
                bwd_ms=mid(v.bwd_ms for v in views),
                wait_ms=mid(v.wait_ms for v in views),
                bcast_ms=mid(v.bcast_ms for v in views),
                late_ms=mid(v.late_ms for v in views),
                cpu_pct=mid(v.cpu_pct for v in views),
                rss_bytes=max(rss) if rss else None,
                status=max((v.status for v in views), key=STATUSES.index),
                lost_for_others_ms=sum(costs) if costs else None,
            )
        )
    return out


def host_ranks(rows: Sequence[RankView]) -> dict[str, list[int]]:
    """The ranks of each host, in rank order."""
    out: dict[str, list[int]] = {}
    for r in sorted(rows, key=lambda r: r.rank):
        out.setdefault(r.host or "?", []).append(r.rank)
    return out
