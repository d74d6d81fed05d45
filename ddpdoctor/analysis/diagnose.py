"""All detectors over a run: per-rank findings merged across ranks, plus cross-rank ones."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

from ddpdoctor.analysis.accumulation import sync_during_accumulation
from ddpdoctor.analysis.bucket_wait import StepArrivals
from ddpdoctor.analysis.buffers import (
    advise_broadcast,
    broadcast_redundancy,
    buffer_broadcast_cost,
    combined_redundancy,
    constant_buffers,
    cross_rank_floor_ms,
)
from ddpdoctor.analysis.comm_advice import advise_communication
from ddpdoctor.analysis.comm_hooks import comm_hook_name
from ddpdoctor.analysis.evidence import FlagEvidence
from ddpdoctor.analysis.findings import SEVERITY_ORDER, Finding, Severity
from ddpdoctor.analysis.from_run import (
    bucket_size_in_run,
    collectives_in_run,
    hangs_in_run,
    lost_in_run,
    nonfinite_in_run,
)
from ddpdoctor.analysis.groups import ddp_groups, group_arrivals
from ddpdoctor.analysis.reduction import orphaned, params_not_reduced
from ddpdoctor.analysis.replicas import compare_fingerprints
from ddpdoctor.analysis.requires_grad import stale_requires_grad
from ddpdoctor.analysis.straggler import (
    exposed_communication,
    exposed_floor_us,
    stragglers,
)
from ddpdoctor.analysis.unused import static_unused_set, unused_parameters
from ddpdoctor.codes import LOGGED_EVIDENCE_CODES, PER_RANK_CODES
from ddpdoctor.events import FindingRecord
from ddpdoctor.runlog import RankLog, Run


def _in(step: int, first: int, nxt: int | None) -> bool:
    return step >= first and (nxt is None or step < nxt)


def rank_findings(
    log: RankLog, bcast_cost_ms: float | None = None, exposed_floor: dict[int, float] | None = None
) -> list[Finding]:
    """What one rank's own log shows, one DDP instance (header segment) at a time."""
    out: list[Finding] = []
    for header, first, nxt in log.segments():
        steps = [s for s in log.steps if _in(s.step, first, nxt)]
        flags = [f for f in log.grad_flags if _in(f.step, first, nxt)]
        prints = [f for f in log.fingerprints if _in(f.step, first, nxt)]
        unused = [u for u in log.unused if _in(u.step, first, nxt)]
        out += stale_requires_grad(header, flags, log.rank)
        flag_evidence = FlagEvidence.of(flags)
        out += params_not_reduced(header, flag_evidence, log.rank)
        orphans = orphaned(flag_evidence)  # (DDP's old tensor of a replacement: not an unused one)
        out += unused_parameters(header, unused, steps, log.rank, frozen=any(f.frozen for f in flags), orphaned=orphans)
        out += static_unused_set(header, unused, steps, log.rank, orphaned=orphans)
        out += constant_buffers(header, prints, steps, log.rank)
        out += buffer_broadcast_cost(header, steps, log.rank, bcast_cost_ms)
    out += sync_during_accumulation(log.steps, log.rank)
    out += exposed_communication(log.steps, log.rank, exposed_floor)
    return out


def _merge_evidence(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    merged = dict(a)
    if isinstance(a.get("names"), list) and isinstance(b.get("names"), list):
        merged["names"] = a["names"] + [n for n in b["names"] if n not in a["names"]]
    return merged


def merge(findings: list[Finding]) -> list[Finding]:
    """One finding per code (per rank for ``PER_RANK_CODES``): ranks united, first step kept, the
    worst severity, names united."""
    by_code: dict[tuple[str, tuple[int, ...]], Finding] = {}
    for f in findings:
        key = (f.code, tuple(f.ranks) if f.code in PER_RANK_CODES else ())
        seen = by_code.get(key)
        if seen is None:
            by_code[key] = Finding(**{**f.to_dict(), "ranks": sorted(set(f.ranks))})
            continue
        seen.ranks = sorted(set(seen.ranks) | set(f.ranks))
        if f.step is not None and (seen.step is None or f.step < seen.step):
            seen.step = f.step
        if SEVERITY_ORDER[f.severity] > SEVERITY_ORDER[seen.severity]:
            seen.severity, seen.title, seen.detail, seen.fix = f.severity, f.title, f.detail, f.fix
        seen.evidence = _merge_evidence(seen.evidence, f.evidence)
    return sorted(by_code.values(), key=lambda f: (-SEVERITY_ORDER[f.severity], f.code, f.ranks))


def _from_record(r: FindingRecord) -> Finding:
    return Finding(
        code=r.code,
        severity=cast(Severity, r.severity),  # the record holds a str; the runtime writes only these
        title=r.title,
        detail=r.detail,
        fix=r.fix,
        ranks=list(r.ranks) or [r.rank],
        step=r.step,
        evidence=dict(r.evidence),
    )


def _whole_run(f: Finding, run: Run, looked_at: int) -> Finding:
    """A straggler judged on sampled steps (a large run is read at a stride): its cost over the whole run."""
    stride = max((log.step_stride for log in run.ranks.values()), default=1)
    total = max((log.steps_total for log in run.ranks.values()), default=0)
    if stride <= 1 or not looked_at or total <= looked_at:
        return f
    estimate = f.evidence["time_lost_ms"] * total / looked_at
    return replace(
        f,
        detail=f"{f.detail} The report read every {stride}th step: over all {total} steps, about "
        f"{estimate / 1000.0:.1f} s were lost.",
        evidence={**f.evidence, "steps_sampled_every": stride, "estimated_run_lost_ms": round(estimate, 1)},
    )


def diagnose(run: Run, arrived: list[list[StepArrivals]] | None = None) -> list[Finding]:
    """Every finding the logs support (``arrived``: each DDP group's bucket arrivals, in the order
    of ``ddp_groups``, if at hand). Replicas and stragglers are compared within a DDP group."""
    steps_by_rank = {r: log.steps for r, log in run.ranks.items()}
    groups = ddp_groups({r: log.header for r, log in run.ranks.items()})
    # across the ranks that meet at DDP's collectives (each DDP group's own): the buffer
    # broadcast's cost, and per step the least exposed communication (what the others' exposed
    # time holds beyond it is waiting for the rank that finished backward last)
    cost: dict[int, float | None] = {}
    floor: dict[int, dict[int, float] | None] = {}
    for members in groups:
        group_steps = {r: steps_by_rank[r] for r in members}
        cost.update(dict.fromkeys(members, cross_rank_floor_ms(group_steps)))
        floor.update(dict.fromkeys(members, exposed_floor_us(group_steps) if len(members) > 1 else None))
    derived = [f for log in run.ranks.values() for f in rank_findings(log, cost.get(log.rank), floor.get(log.rank))]
    verdicts: list[dict[str, Any] | None] = []
    if arrived is None:
        _, arrived = group_arrivals(steps_by_rank, groups)
    for members, group_arrived in zip(groups, arrived, strict=True):
        logs = [run.ranks[r] for r in members]
        group_header = next((log.header for log in logs if log.header is not None), None)
        if group_header is not None:
            broadcast_seen = any(s.bcast_bytes for log in logs for s in log.steps)
            prints = {r: run.ranks[r].fingerprints for r in members}
            derived += compare_fingerprints(group_header, prints, broadcast_seen, comm_hook_name(logs))
            # whether the broadcast is redundant: the group's replicas against each other only
            verdicts.append(broadcast_redundancy(group_header, prints))
        group_steps = {r: steps_by_rank[r] for r in members}
        derived += [_whole_run(f, run, len(group_arrived)) for f in stragglers(group_steps, group_arrived)]
    derived += lost_in_run(run)
    derived += hangs_in_run(run)
    derived += collectives_in_run(run)
    derived += bucket_size_in_run(run)
    derived += nonfinite_in_run(run)  # (each rank's look before the all-reduce, across the ranks)
    codes = {f.code for f in derived}
    logged = [
        _from_record(r)
        for log in run.ranks.values()
        for r in log.findings
        if r.code in LOGGED_EVIDENCE_CODES and r.code not in codes
    ]
    merged = merge(derived + logged)
    verdict = combined_redundancy(verdicts)
    advised = {
        "exposed-communication": lambda f: advise_communication(run, f),
        "buffer-broadcast-cost": lambda f: advise_broadcast(f, verdict),
    }
    return [advised[f.code](f) if f.code in advised else f for f in merged]
