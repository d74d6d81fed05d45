"""From a run to the report: per-rank step-time breakdown, run facts and findings."""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any

from ddpdoctor.analysis.blame import JUDGED, blame, by_host, fold_into_hosts, out_of_line
from ddpdoctor.analysis.clock_align import ClockOffsets
from ddpdoctor.analysis.diagnose import diagnose
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.groups import ddp_groups, group_arrivals, ranks_text
from ddpdoctor.analysis.live_view import end_status
from ddpdoctor.analysis.phases import PHASES, step_phases
from ddpdoctor.events import SCHEMA_VERSION, Header, Layout
from ddpdoctor.runlog import RankLog, Run
from ddpdoctor.runlog.rank_file import is_bare

REPORT_SCHEMA_VERSION = 1
#: Phases reported per rank (medians, ms), plus the cross-rank "bucket_wait".
REPORTED = [
    "step",
    "forward",
    "buffer_sync",
    "backward",
    "allreduce",
    "bucket_wait",
    "exposed_comm",
    "optimizer",
    "rest",
]


@dataclass
class Report:
    """What ``ddpdoctor report`` prints; ``to_dict()`` is the JSON shape of docs/design.md."""

    run: dict[str, Any]
    ranks: list[dict[str, Any]]
    stats: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "run": self.run,
            "ranks": self.ranks,
            "stats": self.stats,
            "findings": [f.to_dict() for f in self.findings],
        }


def _median(values: list[float]) -> float | None:
    return round(median(values), 3) if values else None


def _rank_status(log: RankLog, lost: set[int]) -> str:
    """finished, failed (an exception ended training), terminated (a signal), lost, hung (its
    watchdog saw no progress and it has not resumed), or running (no end record: still writing)."""
    if log.end is None:
        if log.rank in lost:
            return "lost"
        return "hung" if log.hangs and log.hangs[-1].state == "stalled" else "running"
    return end_status(log.end)


def _first_failed(run: Run, clocks: ClockOffsets) -> dict[str, Any] | None:
    """The rank whose log an exception ended first (aligned clocks), with its reason; None when
    no exception ended one."""
    ended = [
        (clocks.aligned_us(r, log.end.t_wall_ns, 0.0), r, log.end.reason)
        for r, log in run.ranks.items()
        if log.end is not None and log.end.reason.startswith("error")
    ]
    if not ended:
        return None
    _, rank, reason = min(ended)
    return {"rank": rank, "reason": reason}


def _rank_entry(log: RankLog, wait_ms: list[float], offset_us: float, method: str, lost: set[int]) -> dict[str, Any]:
    columns: dict[str, list[float]] = {name: [] for name in PHASES}
    # forwards without a backward (an evaluation run with grad on) are steps of their own in the
    # log: left out of the medians, which describe training steps, unless nothing else is there
    trained = [s for s in log.steps if not is_bare(s)] or log.steps
    for s in trained:
        for name, value in step_phases(s).items():
            if value is not None:
                columns[name].append(value)
    medians = {name: _median(columns.get(name, [])) for name in REPORTED if name != "bucket_wait"}
    medians["bucket_wait"] = _median(wait_ms)
    h = log.header
    last = log.steps[-1] if log.steps else None
    return {
        "rank": log.rank,
        "host": h.host if h else None,
        "pid": h.pid if h else None,
        "device": h.device if h else None,
        "local_rank": h.local_rank if h else None,
        "status": _rank_status(log, lost),
        "steps": log.steps_total,
        # steps logged without any bucket all-reduce (a forward with grad on and no backward:
        # an evaluation without torch.no_grad(), a model run twice before one backward), up to 1000
        "forwards_without_backward": len(log.bare_steps),
        "last_step": last.step if last else None,
        "buckets": last.bucket_count() if last else 0,
        "buffer_bytes_per_step": last.bcast_bytes if last else 0,
        "medians_ms": {name: medians[name] for name in REPORTED},
        "clock_offset_ms": round(offset_us / 1000.0, 3),
        "clock_alignment": method,
        "corrupt_lines": log.corrupt_lines,
        "unknown_lines": log.unknown_lines,
        "torn_tail": log.torn_tail,
        "probes_off": [p.probe for p in log.probes_off],
        "stream_dropped": log.stream_dropped,
        "end_reason": log.end.reason if log.end else None,
        "end_signal": log.end.signal if log.end and log.end.signal else None,
    }


#: A rank's median lateness is read from at most this many steps, spread over the run.
LATE_SAMPLES = 1000
#: The numbers the line of the ranks within noise gives (median over them), with their words.
SUMMARISED = (
    ("forward", "forward"),
    ("backward", "backward"),
    ("bucket_wait", "all-reduce wait"),
    ("optimizer", "optimizer"),
    ("late", "late"),
)


def judged_values(entry: dict[str, Any]) -> dict[str, float | None]:
    """A rank entry's numbers as ``blame.out_of_line`` judges them: its medians and lateness."""
    return {**entry["medians_ms"], "late": entry.get("late_ms")}


def _summary(keys: list[Any], values: dict[Any, dict[str, float | None]]) -> dict[str, Any]:
    """The median of each ``SUMMARISED`` number over ``keys`` (ranks or hosts), and the median
    and range of their step."""
    steps = [v for k in keys if (v := values[k].get("step")) is not None]
    return {
        "count": len(keys),
        "step_ms": [_median(steps), round(min(steps), 3), round(max(steps), 3)] if steps else None,
        "medians_ms": {
            name: _median([v for k in keys if (v := values[k].get(name)) is not None]) for name, _ in SUMMARISED
        },
    }


def out_of_line_view(ranks: list[dict[str, Any]], groups: list[list[int]], named: set[int]) -> dict[str, Any]:
    """What every view leads with (``blame.out_of_line``, the one judgement): the ranks and hosts
    out of line, worst first (a rank out of line only as its host is, as a slow node's ranks are,
    is left to its host's entry); the rest of the ranks summarised per DDP group; the hosts."""
    values = {e["rank"]: judged_values(e) for e in ranks}
    hosts = {e["rank"]: e["host"] for e in ranks if e.get("host")}
    rank_out = out_of_line(
        values,
        cost_ms={e["rank"]: e.get("time_lost_for_others_ms") for e in ranks},
        named=named,
        statuses={e["rank"]: e["status"] for e in ranks},
        steps={e["rank"]: e["steps"] for e in ranks},
    )
    host_values = by_host(values, hosts)
    host_out = out_of_line(host_values) if len(host_values) >= 2 else []
    listed = {o.key for o in fold_into_hosts(rank_out, host_out, hosts)}
    members: dict[str, list[int]] = {}
    for rank, host in sorted(hosts.items()):
        members.setdefault(host, []).append(rank)
    out_ranks = {o.key for o in rank_out}
    out_hosts = {o.key for o in host_out}
    within = [
        {"group": ranks_text(g), **_summary([r for r in g if r not in out_ranks and r in values], values)}
        for g in (groups or [sorted(values)])
        if g
    ]
    sizes = sorted({len(m) for m in members.values()})
    return {
        "judged": [name for name, _ in JUDGED],
        "ranks": [
            {
                "rank": o.key,
                "host": hosts.get(o.key) if isinstance(o.key, int) else None,
                "reasons": o.reasons(),
                "excess_ms": {k: round(v, 3) for k, v in o.excess_ms.items()},
                "cost_ms": round(o.cost_ms, 3),
                "status": o.status,
                # listed with its host's entry instead of on its own line
                "in_host": o.key not in listed,
            }
            for o in rank_out
        ],
        "hosts": [
            {
                "host": o.key,
                "ranks": members.get(str(o.key), []),
                "reasons": o.reasons(),
                "excess_ms": {k: round(v, 3) for k, v in o.excess_ms.items()},
            }
            for o in host_out
        ],
        "within_noise": within,
        "nodes": {
            "count": len(members),
            "ranks_per_host": [sizes[0], sizes[-1]] if sizes else None,
            "within_noise": _summary([h for h in host_values if h not in out_hosts], host_values),
        },
    }


def _ddp_options(header: Header | None, layout: Layout | None) -> dict[str, Any]:
    """The header's DDP options, with the comm hook in effect: one registered after ``instrument``
    is named by the layout records only (the header was written at attach)."""
    options = dict(header.ddp_options) if header else {}
    if layout is not None and layout.comm_hook is not None:
        options["comm_hook"] = layout.comm_hook
    return options


def analyze(run: Run) -> Report:
    """Analyze a loaded run (``ddpdoctor.load_run``): per-rank breakdown, stats, findings."""
    steps_by_rank = {r: log.steps for r, log in run.ranks.items()}
    groups = ddp_groups({r: log.header for r, log in run.ranks.items()})
    clocks, arrived_by_group = group_arrivals(steps_by_rank, groups)
    wait_ms: dict[int, list[float]] = {r: [] for r in run.ranks}
    late_ms: dict[int, list[float]] = {r: [] for r in run.ranks}
    for arrived in arrived_by_group:
        for sa in arrived:
            for r, w in sa.wait_us.items():
                wait_ms[r].append(w / 1000.0)
        # each rank's lateness (behind the earliest, at the collective it was latest for): a median,
        # read from at most LATE_SAMPLES steps spread over the run
        for sa in arrived[1:][:: max(1, len(arrived) // LATE_SAMPLES)]:
            for r, lat in sa.lateness_us.items():
                if lat:
                    late_ms[r].append(max(lat) / 1000.0)
    findings = diagnose(run, arrived_by_group)
    lost = {r for f in findings if f.code == "rank-lost" for r in f.ranks}
    ranks = [
        _rank_entry(log, wait_ms[r], clocks.offset_us.get(r, 0.0), clocks.method.get(r, "wall"), lost)
        for r, log in sorted(run.ranks.items())
    ]
    # what each rank cost the others of its DDP group (wall ms over the steps read, margins above
    # the noise floor)
    lost_ms: dict[int, float] = {}
    named: set[int] = set()
    for members, arrived in zip(groups, arrived_by_group, strict=True):
        if len(members) > 1 and arrived:
            blamed = blame({r: steps_by_rank[r] for r in members}, arrived)
            lost_ms.update({r: rb.lost_ms for r, rb in blamed.ranks.items()})
            named |= {rb.rank for rb in blamed.named()}
    for entry in ranks:
        cost = lost_ms.get(entry["rank"])
        entry["time_lost_for_others_ms"] = round(cost, 3) if cost is not None else None
        entry["late_ms"] = _median(late_ms.get(entry["rank"], []))
    header = next((log.header for log in run.ranks.values() if log.header is not None), None)
    layout = None
    for log in run.ranks.values():
        if log.layouts:
            layout = log.layouts[-1]
            break
    run_info: dict[str, Any] = {
        "dir": str(run.dir),
        "run_id": header.run_id if header else None,
        "world_size": run.world_size,
        # the ranks of each DDP group where DDP runs over subgroups of the world (else one group)
        "ddp_groups": groups,
        "ranks_logged": sorted(run.ranks),
        # the DDP model reported (a process may wrap several: a GAN's two), and the others logged
        "ddp_model": run.ddp,
        "other_ddp_models": [m for m in run.models() if m != run.ddp],
        # jobs launched one after another into this run dir before and after the one reported
        "earlier_jobs": run.earlier_jobs,
        "later_jobs": run.later_jobs,
        "missing_ranks": run.missing_ranks(),
        "backend": header.backend if header else None,
        "torch": header.torch if header else None,
        "device": header.device if header else None,
        "hosts": sorted({log.header.host for log in run.ranks.values() if log.header}),
        "ddp_options": _ddp_options(header, layout),
        "log_schema": header.schema if header else SCHEMA_VERSION,
        "corrupt_lines": run.corrupt_lines,
        "unknown_lines": run.unknown_lines,
        "stream_receiver": run.receiver.problems() if run.receiver else None,  # what `collect` refused or lost
        "finished": bool(run.ranks) and all(log.end is not None for log in run.ranks.values()),
        # of the ranks an exception ended, the first on the aligned clocks (where it began: the
        # others' collectives fail once it is gone)
        "first_failed": _first_failed(run, clocks),
        # >1: step statistics come from every n-th step of each rank (and its last steps)
        "steps_sampled_every": max((log.step_stride for log in run.ranks.values()), default=1),
    }
    all_steps = [v for r in ranks for v in ([r["medians_ms"]["step"]] if r["medians_ms"]["step"] is not None else [])]
    stats: dict[str, Any] = {
        "steps": max((r["steps"] for r in ranks), default=0),
        "forwards_without_backward": max((r["forwards_without_backward"] for r in ranks), default=0),
        "median_ms": {
            name: _median([r["medians_ms"][name] for r in ranks if r["medians_ms"][name] is not None])
            for name in REPORTED
        },
        "slowest_rank_step_ms": max(all_steps) if all_steps else None,
        "phases": PHASES | {"bucket_wait": "blocked in all-reduce waiting for slower ranks (max over buckets)"},
        "buckets": [
            {"index": b.index, "bytes": b.bytes, "dtype": b.dtype, "params": len(b.params)} for b in layout.buckets
        ]
        if layout
        else [],
        "layout_rebuilt": any(lay.reason == "rebuilt" for log in run.ranks.values() for lay in log.layouts),
        "out_of_line": out_of_line_view(ranks, groups, named),
    }
    return Report(run=run_info, ranks=ranks, stats=stats, findings=findings)
