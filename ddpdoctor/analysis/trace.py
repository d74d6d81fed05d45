"""A run as a Chrome trace (opens in Perfetto and chrome://tracing): one process per rank.

Each rank gets a "step" track (forward, buffer broadcast, backward, waiting for the all-reduce,
optimizer, the rest until the next step) and one track per gradient bucket (its all-reduce from
launch to completion). Times are on the reference rank's clock (see clock_align), so slices of
different ranks line up even when their hosts' clocks do not. Where DDP runs over subgroups of the
world, each DDP group's clocks are aligned within it (``groups.group_clocks``: ranks of different
groups share no collective to align on) and each process names its group.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analysis.groups import ddp_groups, group_clocks, ranks_text
from ddpdoctor.events import Step
from ddpdoctor.runlog import Run

STEP_TID = 0


def _slice(
    name: str, pid: int, tid: int, start: float, end: float, args: dict[str, Any] | None = None
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "name": name,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": round(start, 3),
        "dur": round(max(0.0, end - start), 3),
    }
    if args:
        event["args"] = args
    return event


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def chrome_trace(run: Run) -> dict[str, Any]:
    """The Chrome trace event JSON object of a run."""
    steps_by_rank = {r: log.steps for r, log in run.ranks.items()}
    groups = ddp_groups({r: log.header for r, log in run.ranks.items()})
    group_of = {r: members for members in groups for r in members} if len(groups) > 1 else {}
    clocks = group_clocks(steps_by_rank, groups)
    starts = [clocks.aligned_us(r, s.t0_wall_ns, 0.0) for r, steps in steps_by_rank.items() for s in steps]
    origin = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    for rank, log in sorted(run.ranks.items()):
        host = log.header.host if log.header else "?"
        group = f", DDP group {ranks_text(group_of[rank])}" if rank in group_of else ""
        events += [
            _meta("process_name", rank, 0, f"rank {rank} ({host}){group}"),
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
            _meta("thread_name", rank, STEP_TID, "step"),
        ]
        buckets_named: set[int] = set()
        # each step is anchored on its own wall-clock reading, which can differ by microseconds from
        # the previous step's monotonic duration: a step's tail must not cross into the next step
        next_start = {
            a.step: clocks.aligned_us(rank, b.t0_wall_ns, 0.0) - origin
            for a, b in zip(log.steps, log.steps[1:], strict=False)
        }
        for s in log.steps:
            # defaults bind this iteration's step and rank (the helpers are only called within it)
            def at_us(rel: float, s: Step = s, rank: int = rank) -> float:
                return clocks.aligned_us(rank, s.t0_wall_ns, rel) - origin

            def at(rel: float | None, s: Step = s, rank: int = rank) -> float | None:
                return None if rel is None else at_us(rel, s, rank)

            step_args = {"step": s.step, "micro": s.micro}
            t0 = at_us(0.0)
            if s.micro and s.fwd_start_us:
                events.append(_slice("no_sync micro-steps", rank, STEP_TID, t0, at_us(s.fwd_start_us), step_args))
            fwd_start, fwd_end = at_us(s.fwd_start_us), at(s.fwd_end_us)
            if fwd_end is not None:
                events.append(_slice("forward", rank, STEP_TID, fwd_start, fwd_end, step_args))
            if s.bcast_start_us is not None and s.bcast_us is not None:
                start = at_us(s.bcast_start_us)
                events.append(
                    _slice(
                        "buffer broadcast",
                        rank,
                        STEP_TID,
                        start,
                        start + s.bcast_us,
                        {"bytes": s.bcast_bytes, **step_args},
                    )
                )
            bwd_end, sync_end = at(s.bwd_end_us), at(s.sync_end_us)
            if fwd_end is not None and bwd_end is not None:
                events.append(_slice("backward", rank, STEP_TID, fwd_end, bwd_end, step_args))
            if bwd_end is not None and sync_end is not None and sync_end > bwd_end:
                events.append(_slice("waiting for all-reduce", rank, STEP_TID, bwd_end, sync_end, step_args))
            opt_start, opt_end = at(s.opt_start_us), at(s.opt_end_us)
            if opt_start is not None and opt_end is not None:
                events.append(_slice("optimizer", rank, STEP_TID, opt_start, opt_end, step_args))
            end = at(s.end_us)
            if end is not None and s.step in next_start:
                end = min(end, next_start[s.step])
            rest_from = opt_end if opt_end is not None else sync_end
            if end is not None and rest_from is not None:
                events.append(_slice("data / other", rank, STEP_TID, rest_from, end, step_args))
            span = None if s.per_bucket() else s.ready_span_us()
            if span is not None and sync_end is not None:
                # a window row of a compact log (or a CUDA step between the sampled ones): the
                # step's communication as one slice, first bucket ready to last bucket done, on
                # the first bucket's track
                if 0 not in buckets_named:
                    buckets_named.add(0)
                    events.append(_meta("thread_name", rank, 1, "bucket 0"))
                args = {"bytes": s.bucket_bytes(), "buckets": s.bucket_count(), "last_ready_us": span[1], **step_args}
                events.append(_slice("all-reduce (all buckets)", rank, 1, at_us(span[0]), sync_end, args))
            for i, (ready, launch, done) in enumerate(zip(s.b_ready_us, s.b_launch_us, s.b_done_us, strict=False)):
                if launch is None or done is None:
                    continue
                if i not in buckets_named:
                    buckets_named.add(i)
                    events.append(_meta("thread_name", rank, i + 1, f"bucket {i}"))
                nbytes = s.b_bytes[i] if i < len(s.b_bytes) else None
                events.append(
                    _slice(
                        f"all-reduce bucket {i}",
                        rank,
                        i + 1,
                        at_us(launch),
                        at_us(done),
                        {"bytes": nbytes, "ready_us": ready, **step_args},
                    )
                )
    other: dict[str, Any] = {
        "run_dir": str(run.dir),
        "clock_offsets_us": {str(r): v for r, v in clocks.offset_us.items()},
    }
    if len(groups) > 1:
        other["ddp_groups"] = groups  # each offset is against its group's lowest rank
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
