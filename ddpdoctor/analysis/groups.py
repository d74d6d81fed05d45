"""Which ranks all-reduce together: one DDP group per run, or several where DDP runs over
subgroups of the world (data parallel inside model-parallel groups).

Ranks of different DDP groups train different replicas (a pipeline stage, a model shard) and
never wait for each other at DDP's collectives: replicas, arrivals and stragglers are compared
within a group only.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddpdoctor.analysis.bucket_wait import StepArrivals, arrivals
from ddpdoctor.analysis.clock_align import ClockOffsets, estimate_offsets
from ddpdoctor.events import Header, Step


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


def group_arrivals(
    steps_by_rank: Mapping[int, list[Step]], groups: list[list[int]]
) -> tuple[ClockOffsets, list[list[StepArrivals]]]:
    """Each group's bucket arrivals, its clocks aligned within it (``groups`` as ``ddp_groups``
    gives them); the offsets of every rank in one ``ClockOffsets``, each against its group's
    lowest rank."""
    offsets: dict[int, float] = {}
    method: dict[int, str] = {}
    arrived: list[list[StepArrivals]] = []
    for members in groups:
        steps = {r: steps_by_rank[r] for r in members if r in steps_by_rank}
        clocks = estimate_offsets(steps)
        offsets.update(clocks.offset_us)
        method.update(clocks.method)
        arrived.append(arrivals(steps, clocks))
    reference = min(steps_by_rank, default=0)
    return ClockOffsets(reference=reference, offset_us=offsets, method=method), arrived
