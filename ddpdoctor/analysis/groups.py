"""Which ranks all-reduce together: one DDP group per run, or several where DDP runs over
subgroups of the world (data parallel inside model-parallel groups).

Ranks of different DDP groups train different replicas (a pipeline stage, a model shard) and
never wait for each other at DDP's collectives: replicas, arrivals and stragglers are compared
within a group only, and clocks are aligned within a group only (the alignment reads the
completion of collectives both ranks took part in; ranks of different groups share none, so
their wall clocks are taken as they are).

Every view that compares ranks (the report, ``compare``, the trace, the plots, the live view)
gets its groups, clocks and arrivals from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ddpdoctor.analysis.bucket_wait import StepArrivals, arrivals
from ddpdoctor.analysis.clock_align import ClockOffsets, estimate_offsets
from ddpdoctor.events import Header, Step

#: Up to this many groups, the text lists each group's ranks; above, their number and size.
LISTED_GROUPS = 4


def ddp_groups(headers: Mapping[int, Header | None]) -> list[list[int]]:
    """The ranks of each DDP group among ``headers`` (rank -> its header), each sorted, the groups
    in order of their lowest rank. Ranks whose header names no subgroup (DDP over the whole world,
    an older log, or no header yet) form one group together."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in sorted(headers):
        header = headers[rank]
        key = tuple(header.group_ranks) if header is not None and header.group_ranks else ()
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values(), key=lambda members: members[0])


def group_clocks(steps_by_rank: Mapping[int, list[Step]], groups: Sequence[Sequence[int]]) -> ClockOffsets:
    """Every rank's clock offset, each against its group's lowest rank (``groups`` as
    ``ddp_groups`` gives them); with one group, exactly ``estimate_offsets``."""
    if len(groups) == 1 and len(groups[0]) == len(steps_by_rank):
        return estimate_offsets(dict(steps_by_rank))
    offsets: dict[int, float] = {}
    method: dict[int, str] = {}
    for members in groups:
        clocks = estimate_offsets({r: steps_by_rank[r] for r in members if r in steps_by_rank})
        offsets.update(clocks.offset_us)
        method.update(clocks.method)
    return ClockOffsets(reference=min(steps_by_rank, default=0), offset_us=offsets, method=method)


def arrivals_in_groups(
    steps_by_rank: Mapping[int, list[Step]], groups: Sequence[Sequence[int]], clocks: ClockOffsets
) -> list[list[StepArrivals]]:
    """Each group's bucket arrivals (``clocks`` as ``group_clocks`` gives them), in group order."""
    if len(groups) == 1 and len(groups[0]) == len(steps_by_rank):
        return [arrivals(dict(steps_by_rank), clocks)]  # the common case: no per-group copy
    return [arrivals({r: steps_by_rank[r] for r in members if r in steps_by_rank}, clocks) for members in groups]


def group_arrivals(
    steps_by_rank: Mapping[int, list[Step]], groups: list[list[int]]
) -> tuple[ClockOffsets, list[list[StepArrivals]]]:
    """Each group's bucket arrivals, its clocks aligned within it (``groups`` as ``ddp_groups``
    gives them); the offsets of every rank in one ``ClockOffsets``, each against its group's
    lowest rank."""
    clocks = group_clocks(steps_by_rank, groups)
    return clocks, arrivals_in_groups(steps_by_rank, groups, clocks)


def merged_arrivals(per_group: Sequence[StepArrivals]) -> StepArrivals | None:
    """One step's arrivals of several groups as one, for a view that shows every rank at once (a
    heatmap): each rank's lateness and wait stay those within its own group. Nothing may be
    compared across the merged ranks (blame takes each group's own arrivals)."""
    if len(per_group) <= 1:
        return per_group[0] if per_group else None
    merged = StepArrivals(
        step=per_group[0].step,
        bcast=all(sa.bcast for sa in per_group),
        per_bucket=all(sa.per_bucket for sa in per_group),
    )
    for sa in per_group:
        merged.lateness_us.update(sa.lateness_us)
        merged.wait_us.update(sa.wait_us)
    return merged


def ranks_text(members: Sequence[int]) -> str:
    """``0,1`` or, for three or more consecutive ranks, ``0-127``."""
    parts: list[str] = []
    start = prev = members[0]
    for r in [*members[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev - start >= 2 else ",".join(map(str, range(start, prev + 1))))
        if r is not None:
            start = prev = r
    return ",".join(parts)


#: Up to this many ranks a finding's words list them one by one; more are said in ranges.
LISTED_RANKS = 8


def ranks_named(ranks: Sequence[int]) -> str:
    """A finding's words for some ranks: "rank 3", "ranks 0, 1", or at scale "ranks 0-199,201-255
    (255 ranks)" (a finding about one lost rank of 2,048 must not list the other 2,047)."""
    ordered = sorted(ranks)
    if len(ordered) <= LISTED_RANKS:
        return f"rank{'s' if len(ordered) > 1 else ''} {', '.join(map(str, ordered))}"
    return f"ranks {ranks_text(ordered)} ({len(ordered)} ranks)"


def groups_text(groups: Sequence[Sequence[int]]) -> str:
    """How the report and the live view say the DDP groups: "" for one group (the common case),
    "in 2 DDP groups (ranks 0,1 / 2,3)", or "in 32 DDP groups of 8 ranks" where there are many."""
    if len(groups) <= 1:
        return ""
    if len(groups) > LISTED_GROUPS:
        sizes = sorted({len(g) for g in groups})
        size = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]}"
        return f"in {len(groups)} DDP groups of {size} ranks"
    return f"in {len(groups)} DDP groups (ranks {' / '.join(ranks_text(g) for g in groups)})"
