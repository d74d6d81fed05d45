"""constant-buffers and buffer-broadcast-cost: what DDP's per-forward buffer broadcast costs."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from statistics import median
from typing import Any

from ddpdoctor.analysis.evidence import BufferEvidence
from ddpdoctor.analysis.findings import Finding, Severity
from ddpdoctor.analysis.framework_switches import framework_switches
from ddpdoctor.analysis.replicas import fingerprints_by_step, tensor_keys
from ddpdoctor.analysis.sizes import counted, human_bytes, name_list
from ddpdoctor.events import Fingerprint, Header, Step

#: Share of the step spent in buffer broadcast that deserves a warning, and an info.
COST_WARNING_SHARE = 0.15
COST_INFO_SHARE = 0.03
#: Training steps a buffer must stay unchanged before it is called constant.
MIN_STEPS_CONSTANT = 3
#: Timed broadcasts whose 10th percentile is taken as the broadcast's floor. From fewer (the live
#: check's first look, a few steps in) the floor is the quickest of the first broadcasts, which
#: start-up and other ranks' lateness slow: a saving from it is said as at most that.
MIN_FLOOR_SAMPLES = 10
#: A broadcast's transfer is taken to cost at most this many times the quickest all-reduce of as
#: many bytes on the same rank (``allreduce_bound_ms``): what the broadcast takes beyond that was
#: waiting for other ranks.
TRANSFER_BOUND_FACTOR = 2.0


_CAPPED = (
    f": this rank waited in every broadcast, so the cost is taken as {TRANSFER_BOUND_FACTOR:g} times its quickest "
    "all-reduce of as many bytes"
)


def _step_transfer_ms(step: Step, launch: list[Any], factors: list[float | None]) -> float | None:
    """``allreduce_bound_ms``'s quickest bucket of one step (ms, before the factor), bucket by
    bucket: the way for a step with a bucket not timed end to end (a None) or of no size."""
    best: float | None = None
    for start, done, factor in zip(launch, step.b_done_us, factors, strict=False):
        if start is None or done is None or factor is None:
            continue
        ms = (done - start) / 1000.0 * factor
        if best is None or ms < best:
            best = ms
    return best


class TransferMemo:
    """``allreduce_bound_ms``'s value of each step, kept from one call to the next: the live
    checks ask over a sliding window, and read each step once instead of at every check whose
    window still holds it. Bounded: past ``limit`` steps it starts over, and a change of the
    buffers' bytes (what the values are scaled to) empties it."""

    __slots__ = ("limit", "_nbytes", "_values")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._nbytes: int | None = None
        self._values: dict[int, tuple[Step, float | None]] = {}  # by id of the step (held: no id reused)

    def values_for(self, nbytes: int) -> dict[int, tuple[Step, float | None]]:
        if nbytes != self._nbytes or len(self._values) > self.limit:
            self._nbytes, self._values = nbytes, {}
        return self._values


def allreduce_bound_ms(
    steps: list[Step], nbytes: int, enough_below: float | None = None, memo: TransferMemo | None = None
) -> float | None:
    """What broadcasting ``nbytes`` can cost at most on this rank, from its own all-reduces:
    ``TRANSFER_BOUND_FACTOR`` times the quickest bucket all-reduce seen (launch to done, scaled up
    to ``nbytes`` when the bucket was smaller). An all-reduce moves at least what a broadcast of as
    many bytes does, in at least as many hops; None without a bucket timed end to end.

    The live checks run this over their window every few dozen steps of a job that broadcasts
    buffers, on the training thread: a step's buckets are read in C-level ``map`` calls, with the
    scale of each bucket size worked out once per layout (the steps of one layout share its list
    of sizes), and bucket by bucket only where a step has a None. The values are those of the
    same arithmetic bucket by bucket.

    ``enough_below``: the caller only asks whether the bound is under this (ms); the first step
    that puts it there ends the search, and its value (not the least) is returned. ``memo``: the
    steps' values from earlier calls (a sliding window's)."""
    best: float | None = None
    # (the bound is best * FACTOR: below ``enough_below`` once best is below this)
    enough = None if enough_below is None else enough_below / TRANSFER_BOUND_FACTOR
    scales: dict[int, list[float | None]] = {}  # by id of a step's list of bucket sizes
    known = memo.values_for(nbytes) if memo is not None else None
    per_ms = itertools.repeat(1000.0)
    ms: float | None
    for s in steps:
        hit = known.get(id(s)) if known is not None else None
        if hit is not None and hit[0] is s:
            ms = hit[1]
        else:
            done = s.b_done_us
            if not done or s.summary:
                continue
            launch = s.b_launch_us or s.b_ready_us
            sizes = s.b_bytes
            factors = scales.get(id(sizes))
            if factors is None:
                factors = scales[id(sizes)] = [max(1.0, nbytes / size) if size else None for size in sizes]
            try:
                took = map(operator.truediv, map(operator.sub, done, launch), per_ms)
                ms = min(map(operator.mul, took, factors))
            except (TypeError, ValueError):  # a None in a column or factor; no bucket in common
                ms = _step_transfer_ms(s, launch, factors)
            if known is not None:
                known[id(s)] = (s, ms)
        if ms is not None and (best is None or ms < best):
            best = ms
            if enough is not None and ms < enough:
                break
    return None if best is None else best * TRANSFER_BOUND_FACTOR


def _bcast_stats(
    steps: list[Step], min_share: float | None = None, memo: TransferMemo | None = None
) -> tuple[float | None, float | None, int, bool]:
    """(broadcast cost ms, step ms, bytes, whether the cost was capped). The broadcast is the
    step's first collective, so it also absorbs the wait for slower ranks (one that loads its data
    late, say): its cost is its floor (10th percentile), what it takes when this rank arrives
    last, capped by what this rank's all-reduces show a transfer costs (``allreduce_bound_ms``): a
    rank that arrives first at every broadcast has no floor free of waiting. Removing the broadcast
    would not remove the wait.

    ``min_share``: the caller reads nothing under this share of the step, so where the floor
    itself is under it the cap (which can only lower the cost) is not worked out, and where the
    cap is, the search for it stops at the first step that puts it under that share (a cost the
    caller drops either way). The live checks run this every few dozen steps of a job that
    broadcasts buffers, on the training thread: on a job whose all-reduces are quick, one step
    settles it, not the window's hundred."""
    bcast = sorted(s.bcast_us for s in steps if s.bcast_us is not None)
    total = [s.end_us for s in steps if s.end_us is not None]
    nbytes = max((s.bcast_bytes for s in steps), default=0)
    floor = bcast[len(bcast) // 10] / 1000.0 if bcast else None
    step_ms = median(total) / 1000.0 if total else None
    if min_share is not None and (floor is None or not step_ms or floor / step_ms < min_share):
        return (floor, step_ms, nbytes, False)
    enough_below = None if min_share is None or not step_ms else min_share * step_ms
    bound = allreduce_bound_ms(steps, nbytes, enough_below, memo) if floor is not None and nbytes else None
    capped = bound is not None and floor is not None and bound < floor
    return (bound if capped else floor, step_ms, nbytes, capped)


#: The fix's line that turns the broadcast off. ``broadcast_buffers`` is the spelling every
#: supported torch takes (from 2.13 it warns that it is deprecated); 2.13's
#: ``forward_sync_buffers=False`` stops the per-forward broadcast and keeps the sync at construction.
BROADCAST_OFF = (
    "    model = DistributedDataParallel(net, broadcast_buffers=False)  # torch>=2.13: forward_sync_buffers=False"
)

#: Where a framework builds the DDP (the user never calls its constructor), its own switch for
#: ``broadcast_buffers=False``: every fix that turns the broadcast off names them.
FRAMEWORK_SWITCHES = framework_switches("broadcast_buffers=False", "ddp_broadcast_buffers=False")


def constant_buffers(
    header: Header, prints: Sequence[Fingerprint] | BufferEvidence, steps: list[Step], rank: int
) -> list[Finding]:
    """Broadcast buffers that never changed since DDP was attached (version and values).

    ``prints``: this rank's fingerprints under ``header``, or the running ``BufferEvidence`` of them.
    """
    evidence = prints if isinstance(prints, BufferEvidence) else BufferEvidence.of(header, prints)
    if evidence.last_step is None or not header.buffers:
        return []
    if evidence.last_step < MIN_STEPS_CONSTANT or not evidence.last_complete:
        return []
    broadcast = [i for i, b in enumerate(header.buffers) if b.broadcast]
    constant = evidence.constant()
    if not broadcast or not constant:
        return []
    names = [header.buffers[i].name for i in constant]
    const_bytes = sum(header.buffers[i].bytes for i in constant)
    all_bytes = sum(header.buffers[i].bytes for i in broadcast)
    bcast_ms, step_ms, _, _ = _bcast_stats(steps)
    everything = len(constant) == len(broadcast)
    saving_ms = None if bcast_ms is None else bcast_ms * (1.0 if everything else const_bytes / max(1, all_bytes))
    share = saving_ms / step_ms if saving_ms is not None and step_ms else None
    severity: Severity = "warning" if share is not None and share >= 0.01 else "info"
    if everything:
        fix = (
            "No buffer changes during training: stop broadcasting them at every forward:\n"
            + BROADCAST_OFF
            + FRAMEWORK_SWITCHES
        )
    else:
        listed = ", ".join(repr(n) for n in names[:20])
        fix = (
            "Exclude just the constant buffers from DDP's broadcast (before wrapping; they are then not synced at "
            "construction either, so make them equal on every rank yourself):\n"
            f"    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, [{listed}])\n"
            "    model = DistributedDataParallel(net)"
        )
    timed = sum(1 for s in steps if s.bcast_us is not None)
    them = "it" if len(names) == 1 else "them"
    if share is None:
        saving = ""
    elif saving_ms is not None and saving_ms < 0.005:
        saving = f"; excluding {them} would save next to nothing per step"
    elif timed < MIN_FLOOR_SAMPLES:
        first = "the first broadcast" if timed == 1 else f"the first {timed} broadcasts"
        saving = (
            f"; excluding {them} would save up to {saving_ms:.2f} ms per step ({share:.1%}; from {first}, which "
            "start-up and the other ranks' lateness slow: the report measures it over the run)"
        )
    else:
        saving = f"; excluding {them} would save about {saving_ms:.2f} ms per step ({share:.1%})"
    return [
        Finding(
            code="constant-buffers",
            severity=severity,
            ranks=[rank],
            step=evidence.first_step,
            title=f"{counted(len(constant), 'constant buffer')} broadcast at every forward",
            detail=(
                f"{name_list(names)} ({human_bytes(const_bytes)}) never changed in {evidence.last_step} steps, yet DDP "
                f"broadcasts {'it' if len(names) == 1 else 'them'} from rank 0 at every forward"
                f"{saving}."
            ),
            evidence={
                "names": names,
                "bytes_per_step": const_bytes,
                "broadcast_bytes_per_step": all_bytes,
                "broadcast_ms": bcast_ms,
                "saving_ms": saving_ms,
                "share_of_step": share,
                "broadcasts_timed": timed,
                "steps_observed": evidence.last_step,
            },
            fix=fix,
        )
    ]


def cross_rank_floor_ms(steps_by_rank: dict[int, list[Step]]) -> float | None:
    """Broadcast cost seen across ranks: per step, the rank that arrived last did not wait, so the
    minimum over ranks is the transfer itself; the low end (10th percentile) of those minima is
    the cost, since a busy machine also delays some steps' collectives."""
    per_step: dict[int, list[float]] = {}
    for steps in steps_by_rank.values():
        for s in steps:
            if s.bcast_us is not None:
                per_step.setdefault(s.step, []).append(s.bcast_us)
    n = len(steps_by_rank)
    mins = sorted(min(v) for v in per_step.values() if len(v) == n)
    return mins[len(mins) // 10] / 1000.0 if n > 1 and mins else None


def buffer_broadcast_cost(
    header: Header, steps: list[Step], rank: int, cost_ms: float | None = None, memo: TransferMemo | None = None
) -> list[Finding]:
    """The share of step time that goes to DDP's buffer broadcast (``cost_ms``: a cross-rank
    estimate of it, when the other ranks' logs are at hand; ``memo``: see ``allreduce_bound_ms``)."""
    bcast_ms: float | None
    if cost_ms is not None:  # (the cap is not read: the cross-rank estimate replaces this rank's)
        _, step_ms, nbytes, _ = _bcast_stats(steps, min_share=float("inf"))
        bcast_ms, capped = cost_ms, False
    else:
        bcast_ms, step_ms, nbytes, capped = _bcast_stats(steps, min_share=COST_INFO_SHARE, memo=memo)
    if bcast_ms is None or not step_ms or len(steps) < 5:
        return []
    share = bcast_ms / step_ms
    if share < COST_INFO_SHARE:
        return []
    first = next(s.step for s in steps if s.bcast_us is not None)
    return [
        Finding(
            code="buffer-broadcast-cost",
            severity="warning" if share >= COST_WARNING_SHARE else "info",
            ranks=[rank],
            step=first,
            title=f"buffer broadcast takes {share:.0%} of the step",
            detail=(
                f"DDP broadcasts {human_bytes(nbytes)} of module buffers from rank 0 at every forward: "
                f"{bcast_ms:.2f} ms of a {step_ms:.2f} ms step ({len(steps)} steps; time spent waiting for other "
                f"ranks inside the broadcast is not counted{_CAPPED if capped else ''})."
            ),
            evidence={
                "broadcast_ms": bcast_ms,
                "step_ms": step_ms,
                "share_of_step": share,
                "bytes_per_step": nbytes,
                "capped_by_allreduce": capped,
            },
            fix=(
                "If the buffers need not match on every rank during training (BatchNorm statistics matter at eval "
                "and checkpoint time), stop the per-forward broadcast and sync them once when needed:\n"
                + BROADCAST_OFF
                + FRAMEWORK_SWITCHES
                + "\n"
                "    # before eval / checkpoint:\n"
                "    for b in model.module.buffers(): torch.distributed.broadcast(b, src=0)"
            ),
        )
    ]


def broadcast_redundancy(header: Header, prints: dict[int, list[Fingerprint]]) -> dict[str, Any] | None:
    """Whether DDP's buffer broadcast does anything for the broadcast buffers that change.

    Only fingerprints taken *outside* a broadcasting forward (``after_broadcast`` false: the final
    fingerprint at close, or one taken between steps) show each rank's own copy after its own
    updates. A changing buffer identical on every rank at every such step is updated the same way
    everywhere (a step counter, a schedule): broadcasting it is redundant. One that differs would
    drift apart without the broadcast (BatchNorm statistics of each rank's batches): turning the
    broadcast off is unsafe. None when no such step or no changing broadcast buffer.
    """
    broadcast = [i for i, b in enumerate(header.buffers) if b.broadcast]
    if len(prints) < 2 or not broadcast:
        return None
    size = len(header.buffers)
    by_step = {
        step: {
            r: fp
            for r, fp in at.items()
            if not fp.after_broadcast and len(fp.buffer_sums) == len(fp.buffer_norms) == size
        }
        for step, at in fingerprints_by_step(prints).items()
    }
    steps = sorted(s for s, at in by_step.items() if set(at) == set(prints))
    if not steps:
        return None
    changing, differing = [], []
    for i in broadcast:
        if not _changed(header, prints, i):
            continue
        b = header.buffers[i]
        changing.append(b.name)
        if any(len(set(tensor_keys(by_step[s], i, buffer=True)[0].values())) > 1 for s in steps):
            differing.append(b.name)
    if not changing:
        return None
    return {"changing": changing, "would_drift": differing, "redundant": not differing, "steps_compared": steps[:100]}


def _changed(header: Header, prints: dict[int, list[Fingerprint]], i: int) -> bool:
    """Whether broadcast buffer ``i`` changed during the run: its version moved from the header's,
    or its values (sum, and the bits where the log has them) differ between two fingerprints of
    one rank, or between ranks at one step (DDP made them equal when it was built).

    The header's checksum is no reference: it is a float64 sum, a fingerprint's a float32 one,
    which differ in the last bits for most float buffers that never change, and a buffer on a GPU
    has none (0.0)."""
    version = header.buffers[i].version
    size = len(header.buffers)
    by_step: dict[int, set[tuple[float | None, int | None]]] = {}
    for fps in prints.values():
        first: tuple[float | None, int | None] | None = None
        for fp in fps:
            if len(fp.buffer_sums) != size:
                continue
            if (fp.buffer_versions[i] if i < len(fp.buffer_versions) else version) != version:
                return True
            values = (fp.buffer_sums[i], fp.buffer_bits[i] if len(fp.buffer_bits) == size else None)
            if first is None:
                first = values
            elif values != first:
                return True
            by_step.setdefault(fp.step, set()).add(values)
    return any(len(seen) > 1 for seen in by_step.values())


def combined_redundancy(verdicts: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Several DDP groups' ``broadcast_redundancy`` verdicts as one (each compares the ranks of
    one group: groups train different models, whose buffers differ by design): redundant only
    where no group's changing buffers differ within it. None when no group has a verdict."""
    found = [v for v in verdicts if v is not None]
    if len(found) <= 1:
        return found[0] if found else None

    def union(key: str) -> list[str]:
        return list(dict.fromkeys(name for v in found for name in v[key]))

    drift = union("would_drift")
    return {
        "changing": union("changing"),
        "would_drift": drift,
        "redundant": not drift,
        "steps_compared": sorted({s for v in found for s in v["steps_compared"]})[:100],
    }


def advise_broadcast(cost: Finding, verdict: dict[str, Any] | None) -> Finding:
    """The ``buffer-broadcast-cost`` finding with what turning the broadcast off would do."""
    if verdict is None:
        return cost
    steps = verdict["steps_compared"]
    listed = f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps[:8]))}"
    at = f"at {counted(len(steps), 'step')} compared outside the broadcast ({listed})"
    saving = cost.evidence.get("broadcast_ms")
    if verdict["redundant"]:
        detail = (
            f"{cost.detail} The buffers that change ({name_list(verdict['changing'])}) were identical on every "
            f"rank {at}: every rank computes the same update, so broadcasting them is redundant"
            f"{f' (saving about {saving:.2f} ms per step)' if saving is not None else ''}."
        )
        fix = (
            "Every rank updates its buffers identically: stop the per-forward broadcast:\n"
            + BROADCAST_OFF
            + FRAMEWORK_SWITCHES
            + "\n"
            "ddpdoctor's final fingerprint will tell if they ever drift apart (buffer-divergence)."
        )
    else:
        detail = (
            f"{cost.detail} {name_list(verdict['would_drift'])} "
            f"{'differs' if len(verdict['would_drift']) == 1 else 'differ'} across ranks between broadcasts {at}: "
            "each rank updates its own copy, so without the broadcast they would drift apart. Turning "
            "broadcast_buffers off is unsafe for them."
        )
        fix = (
            "Keep broadcast_buffers=True: without it these buffers drift apart. Turning it off is only safe if "
            "nothing reads them during training (BatchNorm in train mode uses the batch's statistics) and you "
            "broadcast them yourself before evaluation and checkpointing:\n"
            "    for b in model.module.buffers(): torch.distributed.broadcast(b, src=0)\n"
            "or synchronize them as they are computed (torch.nn.SyncBatchNorm.convert_sync_batchnorm(net) on GPU)."
        )
    return Finding(
        code=cost.code,
        severity=cost.severity,
        title=cost.title,
        detail=detail,
        fix=fix,
        ranks=cost.ranks,
        step=cost.step,
        evidence={
            **cost.evidence,
            "broadcast_redundant": verdict["redundant"],
            "changing_buffers": verdict["changing"],
            "would_drift": verdict["would_drift"],
            "steps_compared_outside_broadcast": steps,
            "predicted_saving_ms": saving if verdict["redundant"] else None,
        },
    )
