"""non-finite-gradient: a rank's own gradient held a NaN or an infinity before DDP averaged it.

Each rank looks at its gradients in the comm hook, before the all-reduce, and logs the first step
where a bucket was not finite (``finding`` record, code ``non-finite-gradient``, evidence: the
step, the buckets and their parameters with NaN and infinity counts). One bad rank's NaN goes
through the all-reduce, so from the next step every rank's gradients are NaN: the ranks that went
bad first are the origin. Where all or most ranks went bad at the same step (a learning rate too
high, an overflow every rank computes), no single rank is blamed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.groups import ranks_named
from ddpdoctor.analysis.sizes import name_list
from ddpdoctor.events import FindingRecord

CODE = "non-finite-gradient"

FIX_ONE_RANK = (
    "Look at what rank {rank} computed at step {step}, before the all-reduce: its batch (NaN or inf in the "
    "inputs, a label out of range, an empty batch averaged), its loss (log(0), a division by zero, sqrt of a "
    "negative). Re-run with torch.autograd.set_detect_anomaly(True) on that step to name the operation. To "
    "survive a bad batch, skip the step when the loss is not finite on any rank (all-reduce a flag first: every "
    "rank must skip together, or DDP's collectives mismatch)."
)
FIX_TOGETHER = (
    "Every rank computed it from its own data at the same step: this is the run's numerics, not one bad batch. "
    "Lower the learning rate (or warm it up), clip the gradient norm (torch.nn.utils.clip_grad_norm_), and with "
    "mixed precision use a GradScaler (float16) or bfloat16. The step before this one is where the loss or the "
    "gradient norm started to grow."
)


#: Parameters named per bucket in a finding's text (the evidence has them all)
SHOWN_PER_BUCKET = 4


def _counts(bucket: Mapping[str, Any]) -> str:
    parts = []
    params = list(bucket.get("params", []))
    for p in params[:SHOWN_PER_BUCKET]:
        kinds = []
        if p.get("nan"):
            kinds.append(f"{p['nan']} NaN")
        if p.get("inf"):
            kinds.append(f"{p['inf']} inf")
        parts.append(f"{p['name']} ({', '.join(kinds) or 'not finite'})")
    if len(params) > SHOWN_PER_BUCKET:
        parts.append(f"{len(params) - SHOWN_PER_BUCKET} more")
    if not parts:
        return "its parameters (a GPU rank knows the bucket, not which of its gradients)"
    return "; ".join(parts)


def names_of(buckets: Sequence[Mapping[str, Any]]) -> list[str]:
    """The parameters named in ``buckets`` (evidence), each once, in order."""
    out: list[str] = []
    for b in buckets:
        for p in b.get("params", []):
            if p["name"] not in out:
                out.append(p["name"])
    return out


SKIPPED = (
    "The weights stayed finite after it: the optimizer step was skipped (a GradScaler does this with float16 "
    "while it calibrates its scale, and then this is expected) or the update never used the gradient."
)
FIX_SKIPPED = (
    "Nothing to do where a GradScaler skips the step (a few such steps at the start of a float16 run are how "
    "it finds its scale). Many of them, or without a GradScaler: treat it as a bad batch or a diverging run "
    "(lower the learning rate, clip the gradient norm)."
)


def rank_nonfinite(
    rank: int,
    step: int,
    buckets: list[dict[str, Any]],
    last_step: int | None = None,
    device: str = "cpu",
    weights_finite: bool | None = None,
) -> Finding:
    """What one rank saw: its first step with a bucket that was not finite before the all-reduce
    (``buckets``: [{"bucket": i, "params": [{"name", "nan", "inf"}]}]). ``last_step`` > ``step``:
    the step is only known to lie in ``step``..``last_step`` (a GPU rank reads its flags lazily).
    ``weights_finite``: whether those parameters were still finite after the step (None: not
    known); where they were, the step was skipped (a GradScaler's) and this is a warning."""
    names = names_of(buckets)
    where = ", ".join(f"bucket {b['bucket']}: {_counts(b)}" for b in buckets)
    when = f"step {step}" if last_step is None or last_step == step else f"steps {step}-{last_step}"
    skipped = weights_finite is True
    return Finding(
        code=CODE,
        severity="warning" if skipped else "error",
        ranks=[rank],
        step=step,
        title=f"Non-finite gradient on rank {rank} at {when}, before the all-reduce",
        detail=(
            f"Rank {rank}'s own gradients were not finite at {when}, before DDP averaged them ({where}). "
            + (
                SKIPPED
                if skipped
                else "The all-reduce spreads a NaN or an infinity to every rank: from the next step every replica's "
                "gradients and weights are not finite."
            )
            + " This rank sees only its own gradients: `ddpdoctor report` compares the ranks and names the one(s) "
            "that went non-finite first."
        ),
        fix=FIX_SKIPPED if skipped else FIX_ONE_RANK.format(rank=rank, step=step),
        evidence={
            "names": names,
            "step": step,
            "last_step": last_step,
            "buckets": buckets,
            "device": device,
            "weights_finite": weights_finite,
        },
    )


def origin_of(per_rank: Mapping[int, Finding], world_size: int) -> Finding | None:
    """The cross-rank verdict from each rank's first non-finite step (``rank_nonfinite``'s
    findings): the rank(s) that went bad first, or all/most ranks together."""
    if not per_rank:
        return None
    first = min(f.step for f in per_rank.values() if f.step is not None)
    origin = sorted(r for r, f in per_rank.items() if f.step == first)
    later = sorted(r for r in per_rank if r not in origin)
    world = max(world_size, len(per_rank))
    steps = {r: f.step for r, f in per_rank.items()}
    buckets = {r: per_rank[r].evidence.get("buckets", []) for r in origin}
    names = [n for r in origin for n in names_of(buckets[r])]
    names = list(dict.fromkeys(names))
    last = max((per_rank[r].evidence.get("last_step") or first for r in origin), default=first)
    when = f"step {first}" if last == first else f"steps {first}-{last}"
    evidence: dict[str, Any] = {
        "names": names,
        "origin_ranks": origin,
        "first_step": first,
        "first_step_by_rank": {str(r): s for r, s in sorted(steps.items())},
        "buckets_by_rank": {str(r): buckets[r] for r in origin},
    }
    if all(per_rank[r].evidence.get("weights_finite") is True for r in origin):
        # every origin rank's weights stayed finite: the step was skipped (a GradScaler's), nothing spread
        return Finding(
            code=CODE,
            severity="warning",
            ranks=origin,
            step=first,
            title=f"Non-finite gradients at {when} on {ranks_named(origin)}, step skipped",
            detail=f"Gradients were not finite at {when}, before the all-reduce (parameters: {name_list(names)}). "
            + SKIPPED,
            fix=FIX_SKIPPED,
            evidence={**evidence, "together": len(origin) >= 2 and 2 * len(origin) > world, "weights_finite": True},
        )
    together = len(origin) >= 2 and 2 * len(origin) > world
    if together:
        everyone = len(origin) == world
        who = "every rank" if everyone else f"{len(origin)} of {world} ranks ({', '.join(map(str, origin))})"
        return Finding(
            code=CODE,
            severity="error",
            ranks=origin,
            step=first,
            title=f"Non-finite gradients on {who} together at {when}, before the all-reduce",
            detail=(
                f"{who[0].upper() + who[1:]} computed NaN or infinite gradients from their own data at {when}, "
                f"before any all-reduce could carry one rank's to the others (parameters: {name_list(names)}). "
                "No single rank is the origin: the training itself diverged."
            ),
            fix=FIX_TOGETHER,
            evidence={**evidence, "together": True},
        )
    who = ranks_named(origin)
    spread = (
        f" The other ranks' gradients went non-finite only later (rank {later[0]} at step {steps[later[0]]}), "
        "after the all-reduce brought them the bad values."
        if later
        else (
            " No other rank logged a non-finite gradient of its own: the all-reduce brought them the bad values."
            if world > len(origin)
            else ""
        )
    )
    where = "; ".join(
        f"rank {r}: " + ", ".join(f"bucket {b['bucket']}: {_counts(b)}" for b in buckets[r]) for r in origin
    )
    return Finding(
        code=CODE,
        severity="error",
        ranks=origin,
        step=first,
        title=f"Non-finite gradient: {who} at {when} is the origin, before the all-reduce",
        detail=(
            f"{who[0].upper() + who[1:]}'s own gradients were not finite at {when}, before DDP averaged them "
            f"({where}).{spread} From then on every replica trains on NaN."
        ),
        fix=FIX_ONE_RANK.format(rank=origin[0], step=first),
        evidence={**evidence, "together": False},
    )


def finding_from_evidence(rank: int, step: int | None, evidence: Mapping[str, Any]) -> Finding:
    """A rank's logged finding, read back from its record's evidence."""
    return rank_nonfinite(
        rank,
        int(evidence.get("step", step if step is not None else 0)),
        list(evidence.get("buckets", [])),
        evidence.get("last_step"),
        str(evidence.get("device", "cpu")),
        evidence.get("weights_finite"),
    )


def per_rank_of(records: Mapping[int, Sequence[FindingRecord]]) -> dict[int, Finding]:
    """Each rank's first non-finite step, from its logged ``finding`` records."""
    out: dict[int, Finding] = {}
    for rank, recs in records.items():
        for r in recs:
            if r.code != CODE:
                continue
            f = finding_from_evidence(rank, r.step, r.evidence)
            if rank not in out or (f.step is not None and f.step < (out[rank].step or 0)):
                out[rank] = f
    return out
