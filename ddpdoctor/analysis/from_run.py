"""The detectors' narrow inputs, read off a loaded ``Run``: what the report (``diagnose``) feeds them.

The detectors themselves (``hang``, ``lost``, ``bucket_size``, ``nonfinite``) take plain records, so the live
view (``live_run``) and the runtime call them on their own state; only this module and the
report know the file-loaded ``Run``/``RankLog``.
"""

from __future__ import annotations

from ddpdoctor.analysis.bucket_sim import CANDIDATE_CAPS_MB
from ddpdoctor.analysis.bucket_size import RankBackward, WhatIf, bucket_size, what_if
from ddpdoctor.analysis.collectives import step_collectives, uneven_collectives
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.groups import ddp_groups
from ddpdoctor.analysis.hang import hang_findings_in_groups
from ddpdoctor.analysis.lost import RankTail, lost_ranks
from ddpdoctor.analysis.nonfinite import finding_from_evidence, origin_of, per_rank_of
from ddpdoctor.runlog import RankLog, Run


def rank_tail(log: RankLog) -> RankTail:
    """The latest records of one rank's log."""
    return RankTail(
        header=log.header,
        last_step=log.steps[-1] if log.steps else None,
        last_proc=log.procs[-1] if log.procs else None,
        end=log.end,
    )


def rank_backward(log: RankLog) -> RankBackward:
    """One rank's header, steps and sampled backward passes."""
    return RankBackward(header=log.header, steps=log.steps, unused=log.unused, rewrapped=len(log.headers) > 1)


def lost_in_run(run: Run) -> list[Finding]:
    """``lost.lost_ranks`` over a loaded run."""
    return lost_ranks({r: rank_tail(log) for r, log in run.ranks.items()})


def hangs_in_run(run: Run) -> list[Finding]:
    """``hang.hang_findings`` over a loaded run."""
    latest = {r: log.hangs[-1] for r, log in run.ranks.items() if log.hangs}
    if not latest:
        return []
    last_step = {r: (log.steps[-1].step if log.steps else None) for r, log in run.ranks.items()}
    ended = {r: log.end.reason for r, log in run.ranks.items() if log.end is not None}
    bare = {r: log.bare_steps for r, log in run.ranks.items()}
    groups = ddp_groups({r: log.header for r, log in run.ranks.items()})
    steps = {r: step_collectives(log.steps) for r, log in run.ranks.items()}
    params = {r: {b.index: b.params for b in log.layouts[-1].buckets} for r, log in run.ranks.items() if log.layouts}
    buffers = {r: [b.name for b in log.header.buffers if b.broadcast] for r, log in run.ranks.items() if log.header}
    return hang_findings_in_groups(
        latest,
        last_step,
        run.world_size,
        groups,
        ended=ended,
        bare_steps=bare,
        collectives=steps,
        bucket_params=params,
        broadcast_buffers=buffers,
    )


def collectives_in_run(run: Run) -> list[Finding]:
    """``collectives.uneven_collectives`` within each DDP group of a loaded run."""
    groups = ddp_groups({r: log.header for r, log in run.ranks.items()})
    out: list[Finding] = []
    for members in groups:
        out += uneven_collectives({r: step_collectives(run.ranks[r].steps) for r in members if r in run.ranks})
    return out


def bucket_size_in_run(run: Run) -> list[Finding]:
    """``bucket_size.bucket_size`` over a loaded run."""
    return bucket_size({r: rank_backward(log) for r, log in run.ranks.items()})


def what_if_run(run: Run, caps_mb: tuple[float, ...] = CANDIDATE_CAPS_MB) -> WhatIf | None:
    """``bucket_size.what_if`` over a loaded run."""
    return what_if({r: rank_backward(log) for r, log in run.ranks.items()}, caps_mb)


def nonfinite_in_run(run: Run) -> list[Finding]:
    """The cross-rank verdict of each DDP group whose ranks logged a non-finite gradient."""
    groups = ddp_groups({r: log.header for r, log in run.ranks.items()})
    out = []
    for members in groups:
        per_rank = per_rank_of({r: run.ranks[r].findings for r in members})
        for r, f in list(per_rank.items()):
            if f.evidence.get("weights_finite") is None:  # (a GPU rank's: its fingerprints say)
                after = [fp for fp in run.ranks[r].fingerprints if f.step is not None and fp.step > f.step]
                if after:
                    finite = all(n is not None and n == n for fp in after for n in fp.param_norms)
                    per_rank[r] = finding_from_evidence(r, f.step, {**f.evidence, "weights_finite": finite})
        found = origin_of(per_rank, len(members))
        if found is not None:
            out.append(found)
    return out
