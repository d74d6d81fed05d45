"""mismatched-collectives: a collective that only some ranks run, named before it hangs the job.

Every rank must run DDP's collectives in the same order: per step, the buffer broadcast of the
synchronizing forward (a model with buffers, ``broadcast_buffers`` on) and the buckets'
all-reduces. A forward through the wrapper on one rank alone (validation or logging on rank 0
only: ``model(x)`` where ``model.module(x)`` was meant) breaks that without any error:

- with grad off, that forward broadcasts the buffers (DDP still holds the flag of the training
  step before) and clears the flag, so the rank's next training forward broadcasts nothing: the
  step's record on that rank has no broadcast where the others' have one. The lone broadcast
  paired with the others' next training broadcast; the job hangs where the counts no longer pair,
  often at its very end (one rank waits in a broadcast while the others sit in a final barrier);
- with grad on, that forward is a step of its own on that rank, with no backward: a step with no
  all-reduce where the others' step of the same index has them (every later step is one off).

Both are read off the step records every rank writes (``Step.bcast_us``, the bucket marks), at
the steps every rank of a DDP group logged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.groups import ranks_named
from ddpdoctor.events import Step


class StepCollectives(NamedTuple):
    """DDP's collectives one rank ran in one step, as its record shows them."""

    broadcast: bool  # the buffer broadcast (in the step's forwards)
    allreduce: bool  # any bucket all-reduce


def step_collectives(steps: Iterable[Step]) -> dict[int, StepCollectives]:
    """Per step index, the collectives of one rank's step records."""
    out = {}
    for s in steps:
        bare = s.b_count == 0 if s.summary else not s.b_ready_us  # (runlog.rank_file.is_bare)
        out[s.step] = StepCollectives(s.bcast_us is not None, not bare)
    return out


def uneven_collectives(per_rank: Mapping[int, Mapping[int, StepCollectives]]) -> list[Finding]:
    """``mismatched-collectives`` at the first step where the ranks of one DDP group ran
    different collectives.

    Args:
        per_rank: per rank of the group, ``step_collectives`` of its steps.
    """
    if len(per_rank) < 2:
        return []
    common = sorted(set.intersection(*(set(c) for c in per_rank.values())))
    for what, label in (("broadcast", "buffer broadcast"), ("allreduce", "gradient all-reduce")):
        odd = [s for s in common if len({getattr(c[s], what) for c in per_rank.values()}) > 1]
        if odd:
            return [_finding(per_rank, what, label, odd)]
    return []


def _finding(per_rank: Mapping[int, Mapping[int, StepCollectives]], what: str, label: str, odd: list[int]) -> Finding:
    first = odd[0]
    without = sorted(r for r, c in per_rank.items() if not getattr(c[first], what))
    with_it = sorted(r for r in per_rank if r not in without)
    lacking = {r: [s for s in odd if not getattr(c[s], what)][:20] for r, c in sorted(per_rank.items())}
    lacking = {r: steps for r, steps in lacking.items() if steps}
    # the rank that ran the extra forward: the one whose steps lack the collective (grad off:
    # its broadcast went to the lone forward) or that logged the extra, bare step (grad on)
    culprit = without
    steps_text = ", ".join(str(s) for s in odd[:5]) + (f" and {len(odd) - 5} more" if len(odd) > 5 else "")
    if what == "broadcast":
        how = (
            f"{ranks_named(without)} ran no buffer broadcast in step {first} where {ranks_named(with_it)} did. "
            "DDP broadcasts the module buffers at every forward through the wrapper; a forward through it with grad "
            f"off (validation under torch.no_grad() on {ranks_named(without)} alone) ran that broadcast instead, "
            f"outside any training step, and paired silently with the others' broadcast of step {first}."
        )
    else:
        how = (
            f"{ranks_named(without)} logged step {first} without any gradient all-reduce while {ranks_named(with_it)} "
            "all-reduced in it: a forward through the wrapper with grad on that no backward followed (validation "
            f"through `model` instead of `model.module` on {ranks_named(without)} alone), or a backward skipped there. "
            "From there on the step indices and collectives of the ranks are one off."
        )
    return Finding(
        code="mismatched-collectives",
        severity="error",
        ranks=culprit,
        step=first,
        title=f"{ranks_named(culprit)}'s {label}s are one off from the other ranks' from step {first}: a forward "
        f"through the DDP wrapper on {ranks_named(culprit)} alone",
        detail=(
            f"{how} Steps where the ranks differ: {steps_text}. Every rank must run DDP's collectives in the same "
            "order; paired one off, the buffers and gradients exchanged come from the wrong forward, and the job "
            "hangs where they can no longer pair (often at its end: one rank in a broadcast, the others in a final "
            "barrier)."
        ),
        evidence={
            "collective": label,
            "first_step": first,
            "steps": odd[:20],
            "without": lacking,
            "ranks_with": with_it,
        },
        fix=(
            f"Run the forward that only {ranks_named(culprit)} runs through the bare model, which runs no collective: "
            "`model.module(x)` instead of `model(x)` (under model.eval() and torch.no_grad() as before). Or run it "
            "on every rank through the wrapper (each rank its share of the validation set)."
            + (
                ""
                if what == "broadcast"
                else " A backward skipped on one rank: skip on every rank together, or run it with a zero loss."
            )
        ),
    )


def evidence_text(evidence: Mapping[str, Any]) -> str:
    """One line for the hang finding: which ranks' steps lacked which collective."""
    lacking = evidence.get("without", {})
    parts = [f"rank {r} in step{'s' if len(s) > 1 else ''} {', '.join(map(str, s[:5]))}" for r, s in lacking.items()]
    return f"{evidence.get('collective', 'a collective')} missing on {'; '.join(parts)}"
