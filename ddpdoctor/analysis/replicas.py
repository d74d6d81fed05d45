"""replica-divergence and buffer-divergence: comparing the ranks' fingerprints at the same steps."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from ddpdoctor.analysis.comm_hooks import local_sgd
from ddpdoctor.analysis.findings import Finding, Severity
from ddpdoctor.analysis.sizes import counted, name_list
from ddpdoctor.events import Fingerprint, Header

RESYNC_FIX = (
    "Find what updates parameters outside DDP's gradient synchronization on some ranks: requires_grad changed "
    "or a parameter replaced after wrapping (rebuild with ddpdoctor.rewrap), optimizer steps after backwards "
    "that all ran inside no_sync(), in-place edits of p.data on some ranks, rank-dependent optimizer state. To "
    "put the replicas back in step (one tensor per call):\n"
    "    for p in model.module.parameters():\n"
    "        torch.distributed.broadcast(p.data, src=0)"
)
BUFFER_FIX = (
    "Buffers are not broadcast (broadcast_buffers=False), so each rank keeps its own. Broadcast them before "
    "evaluation or checkpointing:\n"
    "    for b in model.module.buffers():\n"
    "        torch.distributed.broadcast(b, src=0)\n"
    "or use torch.nn.SyncBatchNorm (GPU) / broadcast_buffers=True."
)
#: The same, where DDP was asked to broadcast them and no step of the run was seen doing it.
BUFFER_UNSEEN_FIX = (
    "DDP was built with broadcast_buffers=True, but no buffer broadcast was seen in any step, so each rank "
    "keeps its own. Check what stops it (a buffer communication hook, for example), or "
    "broadcast them yourself before evaluation or checkpointing:\n"
    "    for b in model.module.buffers():\n"
    "        torch.distributed.broadcast(b, src=0)"
)


#: What to do under local SGD, where the replicas meet only at the model averagings.
LOCAL_SGD_FIX = (
    "Nothing, if the replicas are averaged as planned. ddpdoctor's checks run at fixed steps, not right "
    "after an averaging, so they cannot tell a real divergence from local SGD's own. To check the replicas "
    "where they must agree, call it right after the averaging (every rank):\n"
    "    averager.average_parameters(model.parameters())\n"
    "    ddpdoctor.check_replicas(model)"
)


def _apart_by_design(
    bad: dict[str, tuple[int, list[int], float]], first: int, ranks: list[int], hook: str, compared: list[int]
) -> Finding:
    """replica-divergence under local SGD: information, not an error."""
    names = list(bad)
    return Finding(
        code="replica-divergence",
        severity="info",
        ranks=ranks,
        step=first,
        title=f"{len(names)} parameter(s) differ across ranks between model averagings (local SGD)",
        detail=(
            f"{name_list(names)} differ across ranks from step {first} (steps compared: {_steps_text(compared)}). "
            f"The comm hook {hook} all-reduces within subgroups only once local SGD starts, so the replicas "
            "train apart and meet at each model averaging: that is what it intends."
        ),
        evidence={
            "names": names,
            "first_step": first,
            "compared_steps": compared[:100],
            "ranks_differing": ranks,
            "comm_hook": hook,
            "local_sgd": True,
            "max_relative_difference": max(v[2] for v in bad.values()),
        },
        fix=LOCAL_SGD_FIX,
    )


def tensor_keys(
    at: Mapping[int, Fingerprint], i: int, buffer: bool
) -> tuple[dict[int, tuple[float | None, ...]], list[float]]:
    """What each rank's fingerprint of tensor ``i`` (a parameter, or a buffer) is compared by, and
    the ranks' norms of it (how large a difference is).

    The bits where every rank has them: they are exact, so equal tensors compare equal whatever
    each rank's thread count or vector instructions (a float sum's last bits move with them). The
    norm and the sum where a rank's log has no bits (written before them)."""
    cols = {
        r: (fp.buffer_norms, fp.buffer_sums, fp.buffer_bits)
        if buffer
        else (fp.param_norms, fp.param_sums, fp.param_bits)
        for r, fp in at.items()
    }
    if all(i < len(c[2]) for c in cols.values()):
        keys: dict[int, tuple[float | None, ...]] = {r: (c[2][i],) for r, c in cols.items()}
    else:
        cols = {r: c for r, c in cols.items() if i < len(c[0]) and i < len(c[1])}
        keys = {r: (c[0][i], c[1][i]) for r, c in cols.items()}
    # (a norm that is not finite, None in the log, says nothing of how far apart the ranks are)
    return keys, [n for c in cols.values() if i < len(c[0]) and (n := c[0][i]) is not None]


def _odd_ranks(values: Mapping[int, tuple[float | None, ...]]) -> list[int]:
    """Ranks whose value is not the most common one (all of them on a tie)."""
    counts = Counter(values.values())
    (top, n), *rest = counts.most_common()
    if rest and rest[0][1] == n:
        return sorted(values)
    return sorted(r for r, v in values.items() if v != top)


def _rel_diff(values: list[float]) -> float:
    lo, hi = min(values), max(values)
    scale = max(abs(lo), abs(hi), 1e-30)
    return (hi - lo) / scale


def _size_text(rel: float) -> str:
    """How far apart the ranks' norms are, in words."""
    if rel == 0.0:
        return "their norms agree to float32's precision: the values differ in their last bits"
    return f"largest relative difference of the norms {rel:.2e}"


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 12 else f"{', '.join(map(str, steps[:10]))}, ... {steps[-1]}"


def fingerprints_by_step(prints: Mapping[int, list[Fingerprint]]) -> dict[int, dict[int, Fingerprint]]:
    """Each step's fingerprints, by rank, with every rank's final fingerprint (taken at close)
    counted at the run's end: ranks that end at different steps (uneven inputs under Join, which
    syncs the final model from the last rank to join) are compared with each other there, not a
    rank's end with another rank's mid-run step of the same number."""
    end = max((fp.step for records in prints.values() for fp in records if fp.final), default=0)
    by_step: dict[int, dict[int, Fingerprint]] = {}
    for rank, records in prints.items():
        for fp in records:
            by_step.setdefault(end if fp.final else fp.step, {})[rank] = fp
    return by_step


def compare_fingerprints(
    header: Header, prints: dict[int, list[Fingerprint]], broadcast_seen: bool = False, comm_hook: str = ""
) -> list[Finding]:
    """Parameters and buffers that differ across ranks at a step every rank fingerprinted (not
    those DDP was told to ignore, ``parameters_to_ignore``: the script keeps them, per rank or
    in step, as it chooses).

    ``broadcast_seen``: a step of the run shows DDP broadcasting the buffers. A fingerprint
    taken right after a broadcast shows it too; under gradient accumulation none is, as DDP
    broadcasts in the first micro-step's forward and the checks run in the synchronizing one.
    ``comm_hook``: the group's comm hook; under local SGD (``comm_hooks.local_sgd``) parameters
    that differ are what the hook intends between model averagings, said as information."""
    if len(prints) < 2:
        return []
    by_step = fingerprints_by_step(prints)
    buffers = header.buffers
    bad_params: dict[str, tuple[int, list[int], float]] = {}
    bad_buffers: dict[str, tuple[int, list[int], float]] = {}
    # DDP broadcasts these from rank 0 at the first forward after a synchronized backward: a copy
    # taken between two broadcasts may differ (each rank updated its own), the next broadcast
    # puts them back in step
    broadcasting = broadcast_seen or any(fp.after_broadcast for records in prints.values() for fp in records)
    compared: list[int] = []  # steps every rank fingerprinted, in order
    for step in sorted(by_step):
        at = by_step[step]
        if set(at) != set(prints):
            continue
        compared.append(step)
        for i, param in enumerate(header.params):
            name = param.name
            if param.ignored or name in bad_params:
                continue  # (DDP leaves what it is told to ignore to the script: it may differ by design)
            vals, norms = tensor_keys(at, i, buffer=False)
            if len(set(vals.values())) > 1:
                bad_params[name] = (step, _odd_ranks(vals), _rel_diff(norms))
        for i, buf in enumerate(buffers):
            if buf.broadcast and broadcasting:
                continue  # rank 0's copy is broadcast at every forward: differences do not last
            if buf.ignored or buf.name in bad_buffers:
                continue
            vals, norms = tensor_keys(at, i, buffer=True)
            if len(set(vals.values())) > 1:
                bad_buffers[buf.name] = (step, _odd_ranks(vals), _rel_diff(norms))
    out = []
    checks: tuple[tuple[str, dict[str, tuple[int, list[int], float]], str, str, Severity], ...] = (
        ("replica-divergence", bad_params, "parameter", RESYNC_FIX, "error"),
        (
            "buffer-divergence",
            bad_buffers,
            "buffer",
            BUFFER_UNSEEN_FIX if header.ddp_options.get("broadcast_buffers") is True else BUFFER_FIX,
            "warning",
        ),
    )
    local = local_sgd(comm_hook)
    for code, bad, what, fix, severity in checks:
        if not bad:
            continue
        names = list(bad)
        first = min(v[0] for v in bad.values())
        ranks = sorted({r for v in bad.values() for r in v[1]})
        if local and code == "replica-divergence":
            out.append(_apart_by_design(bad, first, ranks, comm_hook, compared))
            continue
        before = [s for s in compared if s < first]
        last_equal = before[-1] if before else None
        since = (
            f"identical at step {last_equal} (the check before), different at step {first}"
            if last_equal is not None
            else f"different at step {first}, the first step compared"
        )
        out.append(
            Finding(
                code=code,
                severity=severity,
                ranks=ranks,
                step=first,
                title=f"{counted(len(names), what)} {'differs' if len(names) == 1 else 'differ'} across ranks "
                f"from step {first}",
                detail=(
                    f"{name_list(names)} {'is' if len(names) == 1 else 'are'} not identical on every rank: {since} "
                    f"({_who_differs(ranks, len(prints))}; {_size_text(max(v[2] for v in bad.values()))}; "
                    f"steps compared: {_steps_text(compared)}). "
                    + (
                        f"The cause ran between step {last_equal} and step {first}."
                        if last_equal is not None
                        else "The cause ran before it: DDP's constructor made every replica equal."
                    )
                ),
                evidence={
                    "names": names,
                    "first_step": first,
                    "last_equal_step": last_equal,
                    "compared_steps": compared[:100],
                    "ranks_differing": ranks,
                    "max_relative_difference": max(v[2] for v in bad.values()),
                    "per_name": {n: {"step": v[0], "ranks": v[1]} for n, v in list(bad.items())[:50]},
                },
                fix=fix,
            )
        )
    return out


def _who_differs(ranks: list[int], compared: int) -> str:
    """ "rank 1 differs from the others", or, where every rank compared differs (two ranks), "the
    ranks differ from each other"."""
    if len(ranks) >= compared:
        return "the ranks differ from each other"
    many = len(ranks) > 1
    return f"rank{'s' if many else ''} {', '.join(map(str, ranks))} differ{'' if many else 's'} from the others"
