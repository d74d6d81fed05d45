"""unused-parameters and find-unused-unneeded, from the sampled gradient checks.

``find-unused-unneeded`` is always a warning: the flag's graph search after every forward is pure
overhead when its answer never changes (PyTorch itself warns when it finds nothing unused). Its
measured cost is evidence, not the severity: DDP's ``_post_forward`` is timed once per sample, a
fraction of a millisecond on a small model, and a threshold on it would flip the severity with
the machine's load.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

from ddpdoctor.analysis.evidence import UnusedEvidence
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.framework_switches import framework_switches
from ddpdoctor.analysis.sizes import human_bytes, name_list, param_bytes
from ddpdoctor.events import Header, Step, Unused

#: What the sampled checks cannot see, said wherever a finding rests on them alone.
SOMETIMES_UNUSED = (
    "The checks sample steps: parameters unused only on some batches (a branch taken now and then, a "
    "mixture-of-experts expert that got no tokens) may not show in them, and the flag is what makes such "
    "a model train."
)
#: Sampled steps without any unused parameter before find_unused_parameters=True is called needless.
MIN_CLEAN_SAMPLES = 3


def unused_parameters(
    header: Header,
    samples: Sequence[Unused] | UnusedEvidence,
    steps: list[Step],
    rank: int,
    frozen: bool = False,
    orphaned: Sequence[str] = (),
) -> list[Finding]:
    """Findings from one rank's sampled unused-parameter checks (``samples``: the records, or the
    running ``UnusedEvidence`` of them; ``frozen``: some parameter DDP reduces has lost
    requires_grad, which find_unused_parameters=True is then needed for; ``orphaned``: names whose
    tensor DDP reduces was replaced in the module after DDP was built, so DDP's old tensor gets no
    gradient: not unused, and never to be deleted (``param-not-reduced`` says what it is))."""
    evidence = samples if isinstance(samples, UnusedEvidence) else UnusedEvidence.of(samples)
    n_samples = evidence.samples
    if not n_samples:
        return []
    find_unused = bool(header.ddp_options.get("find_unused_parameters"))
    gone = set(orphaned)
    names, first = [n for n in evidence.unused.names if n not in gone], evidence.unused.first
    if gone and not names and evidence.unused.names:
        return []  # every name is an orphan of a replacement: param-not-reduced, not unused
    left_out = [n for n in evidence.unused.names if n in gone]
    orphans = (
        f" ({name_list(left_out)} also got none: DDP's old tensor of a parameter replaced after wrapping, "
        "in use under the same name, not unused: see param-not-reduced.)"
        if left_out
        else ""
    )
    if names:
        nbytes = param_bytes(header, names)
        if find_unused:
            # never used (in any sample, and on no step DDP's map was read at): dead weight; used in
            # some: conditional branches, DDP copes
            never = [n for n in evidence.never_used() if n not in gone]
            return [
                Finding(
                    code="unused-parameters",
                    severity="warning" if never and n_samples >= 2 else "info",
                    ranks=[rank],
                    step=first,
                    title=f"{len(names)} parameter(s) produced no gradient",
                    detail=(
                        f"{name_list(names)} received no gradient in sampled steps"
                        f"{f' ({name_list(never)} in none of the {n_samples} samples)' if never else ''}. "
                        "find_unused_parameters=True handles it, at the cost of a graph search every step; "
                        f"their {human_bytes(nbytes)} are still all-reduced (as zeros) unless unused on every rank."
                        f"{orphans}"
                    ),
                    evidence={
                        "names": names,
                        "never_used": never,
                        "bytes_per_step": nbytes,
                        "samples": n_samples,
                        "orphaned": left_out,
                    },
                    fix=(
                        "If they are never used, delete them from the model (or wrap only the used part). If they are "
                        "used on some steps only, keep find_unused_parameters=True."
                    ),
                )
            ]
        return [
            Finding(
                code="unused-parameters",
                severity="error",
                ranks=[rank],
                step=first,
                title=f"{len(names)} parameter(s) produced no gradient with find_unused_parameters=False",
                detail=(
                    f"{name_list(names)} received no gradient at step {first}. DDP waits for every gradient it "
                    "reduces, so the next iteration fails with 'Expected to have finished reduction in the prior "
                    f"iteration'.{orphans}"
                ),
                evidence={"names": names, "bytes_per_step": nbytes, "orphaned": left_out},
                fix=(
                    "Use every parameter in the forward, or build DDP with find_unused_parameters=True:\n"
                    "    model = DistributedDataParallel(net, find_unused_parameters=True)"
                ),
            )
        ]
    if not find_unused or frozen or n_samples < MIN_CLEAN_SAMPLES or evidence.steps_with_unused:
        return []  # (DDP's own map saw a parameter unused between the samples: the flag is needed)
    post = evidence.post_forward_median_us()
    step_us = [s.end_us for s in steps if s.end_us is not None]
    cost_ms = post / 1000.0 if post is not None else None
    share = (post / median(step_us)) if post is not None and step_us else None
    cost = f" ({cost_ms:.2f} ms per step, {share:.1%} of the step)" if share is not None else ""
    return [
        Finding(
            code="find-unused-unneeded",
            severity="warning",
            ranks=[rank],
            step=evidence.first_step,
            title="find_unused_parameters=True, but every parameter gets a gradient",
            detail=(
                f"In {n_samples} sampled steps no parameter was unused. The flag makes DDP search the autograd "
                f"graph after every forward{cost}"
                " and all-reduce a usage bitmap: pure overhead"
                + (
                    f". DDP's own map of used parameters, read at every step up to the last sample "
                    f"({evidence.steps_read} steps), found none unused either."
                    if evidence.steps_read
                    else f", unless parameters go unused on steps between the samples. {SOMETIMES_UNUSED}"
                )
            ),
            evidence={
                "samples": n_samples,
                "steps_read": evidence.steps_read,
                "post_forward_ms": cost_ms,
                "share_of_step": share,
            },
            fix=(
                "model = DistributedDataParallel(net, find_unused_parameters=False)  # the default"
                + framework_switches("find_unused_parameters=False", "ddp_find_unused_parameters=False")
                + "\nOnly if no parameter can go unused on any batch: otherwise DDP stops at the first such step "
                '("Expected to have finished reduction in the prior iteration").'
            ),
        )
    ]


def static_unused_set(
    header: Header, samples: list[Unused], steps: list[Step], rank: int, orphaned: Sequence[str] = ()
) -> list[Finding]:
    """``find-unused-unneeded`` when find_unused_parameters=True and the *same* parameters are unused
    at every sampled step: DDP need not search the graph after every forward to find them again.

    With ``static_graph=True`` DDP records the unused set once, in the first iteration, and skips
    the search after; removing the parameters also saves their all-reduce. Not said when the set
    changes between samples (conditional branches: the search is what makes them work).
    """
    if not header.ddp_options.get("find_unused_parameters") or header.ddp_options.get("static_graph"):
        return []
    usable = [s for s in samples if s.step >= 1]  # DDP's first iteration is not a steady one
    if len(usable) < MIN_CLEAN_SAMPLES:
        return []
    # DDP's own map, read at every step (find_unused_parameters on CPU): the set must not have
    # changed between the steps, nor been empty at any (from the second sample on, as above)
    read = sum(s.steps_read for s in usable[1:])
    if sum(s.unused_set_changes for s in usable[1:]) or read > sum(s.steps_with_unused for s in usable[1:]):
        return []
    if set(orphaned) & {n for s in usable for n in s.names}:
        return []  # a replaced parameter's orphan: param-not-reduced says what it is, not "remove it"
    sets = {frozenset(s.names) for s in usable}
    if len(sets) != 1 or not next(iter(sets)):
        return []
    names = list(usable[0].names)
    nbytes = param_bytes(header, names)
    post = [s.post_forward_us for s in usable if s.post_forward_us is not None]
    step_us = [s.end_us for s in steps if s.end_us is not None]
    cost_ms = median(post) / 1000.0 if post else None
    share = median(post) / median(step_us) if post and step_us else None
    cost = f" ({cost_ms:.2f} ms per step, {share:.1%} of the step)" if cost_ms is not None and share is not None else ""
    return [
        Finding(
            code="find-unused-unneeded",
            severity="warning",
            ranks=[rank],
            step=usable[0].step,
            title=f"find_unused_parameters=True finds the same {len(names)} unused parameter(s) at every step",
            detail=(
                f"{name_list(names)} got no gradient at each of the {len(usable)} sampled steps, always the same set. "
                f"DDP still searches the autograd graph after every forward to find them{cost}, and all-reduces "
                f"their {human_bytes(nbytes)} of zeros. A static set needs no search. "
                + (
                    f"DDP's own map of used parameters, read at every step between the samples ({read} steps), "
                    "found the set unchanged too."
                    if read
                    else SOMETIMES_UNUSED
                )
            ),
            evidence={
                "names": names,
                "samples": len(usable),
                "post_forward_ms": cost_ms,
                "share_of_step": share,
                "predicted_saving_ms": cost_ms,
                "bytes_per_step": nbytes,
                "static_set": True,
            },
            fix=(
                "If the set is the same on every batch, tell DDP the graph is static (it records the unused set "
                "once):\n"
                "    model = DistributedDataParallel(net, static_graph=True)\n"
                f"or remove the unused parameters from the model ({name_list(names)}) and use "
                "find_unused_parameters=False, which also stops their all-reduce."
            ),
        )
    ]
