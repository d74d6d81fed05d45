"""hang: ranks blocked in a collective, and the rank(s) that are not there.

Each rank's watchdog records where it stalls (``hang`` records). A rank stalled inside a
collective (a bucket's all-reduce, the buffer broadcast) waits for someone; every rank that is
not waiting in that same collective is missing from it, and its own record (phase, step, stack)
says where it is instead. A rank that ran one collective fewer than the others (a backward
skipped on one rank) lets every later collective pair with the wrong partner without any error,
until the last one waits forever: its log then shows a step without any bucket all-reduce.

Where the step marks cannot tell (a forward through the wrapper outside a training step, a
collective of the script's own such as a final barrier), the watchdog reads the collective off
the stack (``Hang.collective``): a job hung at its end is a hang too. Each missing rank gets its
cause: it left its loop (uneven inputs), waits in another collective, ran a step without
all-reduce, is busy in its own code, or crashed; the ranks' step records name a collective that
only some ranks ran (``collectives``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from ddpdoctor.analysis.collectives import StepCollectives, uneven_collectives
from ddpdoctor.analysis.collectives import evidence_text as collectives_text
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.sizes import name_list
from ddpdoctor.events import Hang

_V = TypeVar("_V")

#: Phases in which a stalled rank is waiting for the other ranks ("collective": one of the
#: script's own, read from its stack: ``Hang.collective``).
COLLECTIVE_PHASES = ("allreduce", "buffer broadcast", "collective")


def where_waiting(h: Hang) -> str:
    """Where a stalled rank is, in words: "the all-reduce of bucket 2 of step 7"."""
    if h.phase == "allreduce":
        return f"the all-reduce of bucket {h.pending_bucket} of step {h.step}"
    if h.phase == "buffer broadcast" and h.collective:
        return f"the buffer broadcast of a forward outside the training steps, after step {h.step}"
    if h.phase == "buffer broadcast":
        return f"the buffer broadcast of step {h.step}"
    if h.phase == "collective":
        return f"torch.distributed.{h.collective}(), after step {h.step}"
    return f"{h.phase} at step {h.step}"


_where = where_waiting


def _is_library(frame: str) -> bool:
    path = frame.split(":", 1)[0].replace("\\", "/")
    if path.startswith("<"):  # "<string>": a launcher's entry (multiprocessing's spawn_main)
        return True
    return "/site-packages/" in path or "/ddpdoctor/runtime/" in path or "/lib/python3" in path


def _stack_tail(h: Hang, frames: int = 3) -> str:
    """The innermost frames of the training script (where it is in user code), then the innermost one."""
    user = [line for line in h.stack if not _is_library(line)]
    shown = user[-frames:]
    if h.stack and h.stack[-1] not in shown:
        shown += ["...", h.stack[-1]]
    return "\n".join("    " + line for line in shown)


def hang_findings(
    latest: dict[int, Hang],
    last_step: dict[int, int | None],
    world_size: int,
    *,
    ended: dict[int, str] | None = None,
    no_allreduce_steps: dict[int, list[int]] | None = None,
    members: list[int] | None = None,
    mismatch: Finding | None = None,
    bucket_params: Mapping[int, list[str]] | None = None,
    broadcast_buffers: Sequence[str] = (),
) -> list[Finding]:
    """The ``hang`` finding from each rank's latest watchdog record.

    Args:
        latest: per rank, its latest ``hang`` record (``stalled`` or ``resumed``).
        last_step: per rank, the last step it logged (None before any).
        world_size: ranks in the job (a rank with no record at all is missing too).
        ended: ranks whose log closed, with the end reason.
        no_allreduce_steps: per rank, steps it logged without any bucket all-reduce while other
            ranks did all-reduce in them (the usual cause: a backward skipped on that rank).
        members: the ranks that all-reduce together (one DDP group; None: every rank of the job):
            a rank of another group is never missing from this group's collective.
        mismatch: the group's ``mismatched-collectives`` finding, if any (``collectives``): the
            cause of the hang, named with it.
        bucket_params: per bucket index, its parameters (the latest layout), to name the
            parameters of the bucket whose all-reduce waits.
        broadcast_buffers: the buffers DDP broadcasts at each forward (the header's), to name
            what a waiting buffer broadcast carries.
    """
    ended = ended or {}
    stalled = {r: h for r, h in latest.items() if h.state == "stalled"}
    waiting = {r: h for r, h in stalled.items() if h.phase in COLLECTIVE_PHASES}
    out: list[Finding] = []
    for rank, h in sorted(latest.items()):
        if h.state == "resumed":
            out.append(
                Finding(
                    code="hang",
                    severity="info",
                    ranks=[rank],
                    step=h.step,
                    title=f"rank {rank} made no progress for {h.waited_s:.0f} s ({h.phase}, step {h.step}), "
                    "then resumed",
                    detail="A stall longer than the hang timeout that ended by itself (a slow checkpoint, evaluation, "
                    "or a rank that was late).",
                    evidence={"phase": h.phase, "waited_s": h.waited_s},
                    fix="If this is expected work between steps, raise hang_timeout (DDPDOCTOR_HANG_TIMEOUT).",
                )
            )
    if not waiting:
        return out
    # the collective the job is stuck in: the earliest of DDP's a rank waits in (a rank that skipped a
    # collective runs ahead and waits in a later one, or leaves training: a rank in a collective of
    # the script's own, a final barrier, is missing from DDP's)
    order = {"buffer broadcast": 0, "allreduce": 1}
    stuck = min(
        waiting.values(), key=lambda h: (h.phase not in order, h.step, order.get(h.phase, 2), h.pending_bucket or 0)
    )
    at = _where(stuck)
    waiters = sorted(r for r, h in waiting.items() if _where(h) == at)
    everyone = members if members is not None else range(max(world_size, max(latest) + 1))
    missing = [r for r in everyone if r not in waiters]
    plural = len(waiters) > 1
    waits = f"rank{'s' if plural else ''} {', '.join(map(str, waiters))} wait{'' if plural else 's'} in {at}"
    lines, missing_info, skipped = [], {}, no_allreduce_steps or {}
    for r in missing:
        rec = stalled.get(r)
        info: dict[str, Any] = {"last_step": last_step.get(r)}
        if r in ended:
            crashed = ended[r].startswith("error")
            info["cause"] = "crashed" if crashed else "left-loop"
            how = "an exception ended it" if crashed else "it left the training loop while the others went on"
            text = f"rank {r} has left training: its log ended ({ended[r]}) after step {last_step.get(r)}: {how}"
            info["ended"] = ended[r]
        elif rec is not None:
            in_collective = rec.phase in COLLECTIVE_PHASES
            left = rec.phase == "collective" and stuck.phase != "collective" and rec.step < stuck.step
            info["cause"] = "left-loop" if left else "other-collective" if in_collective else "stuck-in-compute"
            ahead = " (it is ahead: it skipped the collective the others wait in)" if rec.step > stuck.step else ""
            busy = "" if in_collective else " (no collective on its stack: it is busy in its own code)"
            if left:
                busy = " (it left its training loop while the others train on)"
            text = (
                f"rank {r} has waited {rec.waited_s:.0f} s in {_where(rec)}{ahead}{busy}; its stack:\n"
                f"{_stack_tail(rec)}"
            )
            info.update(phase=rec.phase, step=rec.step, stack=rec.stack)
            if rec.collective:
                info["collective"] = rec.collective
        elif r not in latest and last_step.get(r) is None:
            info["cause"] = "silent"
            text = f"rank {r} has logged nothing"
        else:
            info["cause"] = "silent"
            text = (
                f"rank {r} last logged step {last_step.get(r)} and recorded no stall: it is still busy outside "
                "DDP's steps, or it died without a word (see rank-lost)"
            )
        if skipped.get(r):
            text += (
                f"\n    rank {r} logged step{'s' if len(skipped[r]) > 1 else ''} "
                f"{', '.join(map(str, skipped[r][:5]))} without any gradient all-reduce while the others "
                "all-reduced: from there on its collectives paired with the wrong ones, one step apart"
            )
            info["steps_without_allreduce"] = skipped[r][:20]
            info["cause"] = "skipped-backward"
        lines.append(text)
        missing_info[r] = info
    if mismatch is not None:
        lines.append(
            f"cause: {collectives_text(mismatch.evidence)} (see mismatched-collectives): a forward through the DDP "
            f"wrapper that only rank{'s' if len(mismatch.ranks) > 1 else ''} {', '.join(map(str, mismatch.ranks))} "
            "ran; the collectives paired one off from there on"
        )
    for r in waiters:
        lines.append(f"rank {r}'s stack (waiting):\n{_stack_tail(waiting[r])}")
    pending = stuck.pending_bucket if stuck.phase == "allreduce" else None
    params = list((bucket_params or {}).get(pending, [])) if pending is not None else []
    if params:
        lines.append(f"bucket {pending} holds {name_list(params)}")
    buffers = list(broadcast_buffers) if stuck.phase == "buffer broadcast" else []
    if buffers:
        lines.append(f"the broadcast carries {_carries(buffers)}")
    first = stuck.step
    waited = {
        r: {
            "phase": waiting[r].phase,
            "step": waiting[r].step,
            "pending_bucket": waiting[r].pending_bucket,
            "waited_s": waiting[r].waited_s,
            "collective": waiting[r].collective,
            "stack": waiting[r].stack,
        }
        for r in waiters
    }
    longest = max(h.waited_s for h in waiting.values())
    if not missing:
        out.append(_nobody_missing(waited, longest, at, first, params, buffers, ddp=stuck.phase != "collective"))
        return out
    causes = {missing_info[r].get("cause") for r in missing}
    if mismatch is not None:
        fix = "Every rank must run the same collectives in the same order. " + mismatch.fix
    elif any(skipped.get(r) for r in missing):
        fix = (
            "Every rank must run the same collectives in the same order: the missing rank skipped a backward "
            "(or ran one more, or ran a forward through the wrapper with grad on that no backward followed: "
            "validation through `model` instead of `model.module` on one rank). Look for data-dependent "
            "control flow around loss.backward() (skipping a batch on a NaN loss or an empty batch on one rank "
            "only); skip on all ranks together (agree "
            "with an all_reduce of a flag) or run the backward with a zero loss instead."
        )
    elif causes == {"left-loop"}:
        fix = (
            "The ranks ran different numbers of steps: uneven inputs (a rank with fewer batches left its loop "
            "while the others still train). Give every rank the same number of batches "
            "(DistributedSampler(drop_last=True), or the same len() per rank), or wrap the loop in "
            "`with torch.distributed.algorithms.join.Join([model]):`, which shadows the collectives of a "
            "rank that ran out of data."
        )
    elif causes == {"stuck-in-compute"}:
        fix = (
            "The missing rank is in its own code, not in a collective: its stack shows where. Evaluation, "
            "checkpointing or logging on that rank alone (run it on every rank, or keep it under the process "
            "group's timeout), an endless loop, a lock, a data loader or file read that does not return. "
            "`py-spy dump --pid PID` on its host shows native frames too."
        )
    else:
        fix = (
            "Look at the missing rank's stack: it is where that rank is instead of the collective. Usual "
            "causes: an uneven last batch (use DistributedSampler(drop_last=True) or the Join context "
            "manager), evaluation or checkpointing on one rank only, an exception swallowed on one rank, "
            "a collective inside data-dependent control flow."
        )
    why = {
        "left-loop": "left its training loop",
        "crashed": "ended by an exception",
        "stuck-in-compute": "busy in its own code",
        "other-collective": "in another collective",
        "skipped-backward": "a step without all-reduce",
    }
    because = sorted({why[c] for c in causes if c in why})
    out.append(
        Finding(
            code="hang",
            severity="error",
            ranks=missing,
            step=first,
            title=f"{waits}; missing: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
            + (f" ({', '.join(because)})" if because else ""),
            detail=f"{waits[0].upper()}{waits[1:]} (no progress for {longest:.0f} s).\n" + "\n".join(lines),
            evidence={
                "waiting": waited,
                "missing": missing_info,
                **({"broadcast_buffers": buffers} if buffers else {}),
            },
            fix=fix,
        )
    )
    return out


def _carries(buffers: list[str]) -> str:
    """What a buffer broadcast sends, in words."""
    return f"rank 0's module buffers ({name_list(buffers)}): DDP broadcasts them at each forward (broadcast_buffers)"


def _nobody_missing(
    waited: dict[int, dict[str, Any]],
    longest: float,
    at: str,
    step: int,
    params: list[str],
    buffers: list[str],
    ddp: bool = True,
) -> Finding:
    """Every rank waits in the same collective (``waited``: the finding's evidence of each):
    none is missing, the collective does not finish."""
    ranks = sorted(waited)
    holds = f" Its bucket holds {name_list(params)}." if params else ""
    if buffers:
        holds = f" It carries {_carries(buffers)}."
    return Finding(
        code="hang",
        severity="error",
        ranks=ranks,
        step=step,
        title=f"every rank waits in {at}: no rank is missing, the collective does not complete",
        detail=(
            f"Ranks {', '.join(map(str, ranks))} all wait in {at} (no progress for {longest:.0f} s), so none of "
            f"them skipped or added a collective: the collective they all entered never finishes.{holds}"
        ),
        evidence={"waiting": waited, "missing": {}},
        fix=(
            "Suspect the backend or the network (NCCL_DEBUG=INFO, a firewall, a wrong interface: NCCL_SOCKET_IFNAME / "
            "GLOO_SOCKET_IFNAME), or a process group that not every rank passes to the call (a subgroup, another "
            "group's barrier)."
            if not ddp
            else "Suspect what runs the collective: a comm hook (yours, or a library's such as PowerSGD: check that it "
            "completes its future, and that it issues the same collectives on every rank), the process group "
            "(a backend that cannot run this collective on these tensors or devices), or the network between "
            "the hosts (NCCL_DEBUG=INFO, a firewall, a wrong interface: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME). "
            "Run once without the hook to tell which."
        ),
    )


def steps_without_allreduce(
    bare_steps: dict[int, list[int]], last_step: dict[int, int | None], latest: dict[int, Hang]
) -> dict[int, list[int]]:
    """Per rank, its bare steps (logged without any bucket all-reduce) in which another rank did
    all-reduce: it reached that step, logged buckets in it or is stuck in it with buckets ready.

    Args:
        bare_steps: per rank, the steps it logged without any bucket (``RankLog.bare_steps``).
        last_step: per rank, the last step it logged (None before any).
        latest: per rank, its latest ``hang`` record.
    """
    bare_sets = {o: set(steps) for o, steps in bare_steps.items()}

    def all_reduced(o: int, step: int) -> bool:
        h = latest.get(o)
        if h is not None and h.step == step:
            return h.buckets_ready > 0  # the step it is stuck in is not logged yet
        last = last_step.get(o)
        return last is not None and last >= step and step not in bare_sets.get(o, ())

    ranks = set(last_step) | set(bare_steps)
    out: dict[int, list[int]] = {}
    for r, steps in bare_steps.items():
        bare = [s for s in steps if any(all_reduced(o, s) for o in ranks if o != r)]
        if bare:
            out[r] = bare
    return out


def hang_findings_in_groups(
    latest: dict[int, Hang],
    last_step: dict[int, int | None],
    world_size: int,
    groups: list[list[int]],
    *,
    ended: dict[int, str] | None = None,
    bare_steps: dict[int, list[int]] | None = None,
    history: dict[int, Hang] | None = None,
    collectives: Mapping[int, Mapping[int, StepCollectives]] | None = None,
    bucket_params: Mapping[int, Mapping[int, list[str]]] | None = None,
    broadcast_buffers: Mapping[int, Sequence[str]] | None = None,
) -> list[Finding]:
    """``hang_findings`` within each DDP group (``groups.ddp_groups``): ranks of different groups
    never meet at DDP's collectives, so a hang in one group names its own missing ranks, and a
    skipped backward is found by comparing a rank with its own group. ``bare_steps``: per rank, its
    steps without any bucket; ``history``: every rank's latest hang record where ``latest`` holds
    only the current ones (the live view), for telling a skipped backward. ``collectives``: per
    rank, the collectives of its steps (``collectives.step_collectives``), for the cause;
    ``bucket_params``: per rank, its latest layout's parameters per bucket index;
    ``broadcast_buffers``: per rank, the buffers DDP broadcasts at its forwards."""
    ended = ended or {}
    bare_steps = bare_steps or {}
    history = history if history is not None else latest
    whole = len(groups) <= 1
    out: list[Finding] = []
    for members in groups if not whole else [None]:
        group_latest = _only(latest, members)
        if not group_latest:
            continue
        skipped = None
        if any(h.state == "stalled" and h.phase in COLLECTIVE_PHASES for h in group_latest.values()):
            skipped = steps_without_allreduce(
                _only(bare_steps, members), _only(last_step, members), _only(history, members)
            )
        out += hang_findings(
            group_latest,
            _only(last_step, members),
            world_size,
            ended=_only(ended, members),
            no_allreduce_steps=skipped,
            members=members,
            mismatch=next(iter(uneven_collectives(_only(dict(collectives or {}), members))), None),
            bucket_params=next((p for r, p in sorted((bucket_params or {}).items()) if r in group_latest), None),
            broadcast_buffers=next((b for r, b in sorted((broadcast_buffers or {}).items()) if r in group_latest), ()),
        )
    return out


def _only(values: dict[int, _V], members: list[int] | None) -> dict[int, _V]:
    """``values`` of the ``members`` ranks (None: all)."""
    return values if members is None else {r: v for r, v in values.items() if r in members}
