"""LiveRun: the live cross-rank state behind ``ddpdoctor watch``, on synthetic and real runs."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddpdoctor.analysis.live_run import FindingKey, LiveRun
from ddpdoctor.analysis.live_view import LiveSnapshot
from ddpdoctor.events import (
    BucketInfo,
    End,
    Hang,
    Header,
    Layout,
    ProcSample,
    Step,
    encode,
)
from ddpdoctor.events.layout import rank_file_name
from ddpdoctor.runlog import DirSource
from ddpdoctor.runlog.source import RankRecord

T0_NS = 1_700_000_000_000_000_000  # fixed wall clock: synthetic runs render the same every time


def synthetic_records(
    rank: int,
    world: int,
    steps: range,
    *,
    buckets: int = 4,
    step_ms: float = 100.0,
    straggler: int | None = None,
    late_ms: float = 40.0,
    straggle_from: int = 0,
    straggle_until: int | None = None,
    header: bool = True,
    end: str | None = "close",
    hang_at: int | None = None,
    late_at: Callable[[int], dict[int, float]] | None = None,
) -> list[Any]:
    """One rank's records: a header and layout, steps whose buckets every rank leaves together
    (the collective completes when the last rank arrives), a proc sample, an end or a stall.

    ``late_at(step)``: rank -> ms late at that step (replaces ``straggler``: any rank, any step)."""
    out: list[Any] = []
    clock_ns = T0_NS
    if header:
        out.append(
            Header(
                rank=rank,
                run_id="synthetic",
                world_size=world,
                host=f"node{rank // 8}",
                pid=1000 + rank,
                backend="gloo",
                t_mono_ns=0,
                t_wall_ns=T0_NS,
            )
        )
        out.append(
            Layout(
                rank=rank,
                step=0,
                reason="initial",
                buckets=[BucketInfo(index=i, params=[f"p{i}"], bytes=1 << 16, dtype="float32") for i in range(buckets)],
            )
        )
    for step in steps:
        if hang_at is not None and step >= hang_at:
            break
        straggling = straggle_from <= step and (straggle_until is None or step < straggle_until)
        late = late_ms if straggler is not None and straggling else 0.0
        mine = late if rank == straggler else 0.0
        t0 = T0_NS + int(step * (step_ms + late) * 1e6)
        if late_at is not None:
            lates = late_at(step)
            late, mine = max(lates.values(), default=0.0), lates.get(rank, 0.0)
            t0, clock_ns = clock_ns, clock_ns + int((step_ms + late) * 1e6)
        ready = [30_000.0 + 10_000.0 * i + mine * 1000 for i in range(buckets)]
        done = [30_000.0 + 10_000.0 * i + late * 1000 + 2_000.0 for i in range(buckets)]
        out.append(
            Step(
                rank=rank,
                step=step,
                t0_mono_ns=t0 - T0_NS,
                t0_wall_ns=t0,
                fwd_start_us=0.0,
                fwd_us=20_000.0,
                fwd_end_us=20_000.0,
                bwd_end_us=ready[-1],
                b_ready_us=ready,
                b_launch_us=[t + 100 for t in ready],
                b_done_us=done,
                b_bytes=[1 << 16] * buckets,
                sync_end_us=done[-1],
                opt_start_us=done[-1],
                opt_end_us=done[-1] + 1000.0,
                end_us=(step_ms + late) * 1000,
            )
        )
        if step % 10 == 0:
            out.append(
                ProcSample(rank=rank, t_mono_ns=t0 - T0_NS, t_wall_ns=t0, cpu_pct=95.0 + rank, rss_bytes=300 << 20)
            )
    last_ns = T0_NS + int(len(steps) * step_ms * 1e6)
    if hang_at is not None:
        out.append(
            Hang(
                rank=rank,
                t_mono_ns=last_ns - T0_NS,
                t_wall_ns=last_ns,
                step=hang_at,
                phase="between steps" if rank == world - 1 else "allreduce",
                pending_bucket=None if rank == world - 1 else 0,
                waited_s=30.0,
                buckets=buckets,
                stack=[
                    "train.py:40 in main",
                    "train.py:12 in evaluate" if rank == world - 1 else "torch/autograd/__init__.py:200 in backward",
                ],
            )
        )
    elif end is not None:
        out.append(End(rank=rank, t_mono_ns=last_ns - T0_NS, t_wall_ns=last_ns, steps=len(steps), reason=end))
    return out


def write_run(directory: Path, world: int = 4, steps: int = 30, **kwargs: Any) -> Path:
    """A finished synthetic run dir, deterministic to the byte."""
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        with open(directory / rank_file_name(rank), "wb") as f:
            f.writelines(encode(rec) for rec in synthetic_records(rank, world, range(steps), **kwargs))
    return directory


def feed_all(directory: Path, **kwargs: Any) -> tuple[LiveRun, LiveSnapshot]:
    """A run dir replayed into a fresh ``LiveRun`` (``kwargs``: its options), and its snapshot."""
    source = DirSource(directory)
    try:
        live = LiveRun(label=str(directory), **kwargs)
        live.feed(source.poll())
        live.set_source_health(source.health())
    finally:
        source.close()
    return live, live.snapshot()


def test_a_finished_healthy_run(tmp_path: Path) -> None:
    _, snap = feed_all(write_run(tmp_path / "run", world=4, steps=30))
    assert snap.finished and snap.health == "ok" and snap.world_size == 4 and snap.backend == "gloo"
    assert [r.status for r in snap.ranks] == ["finished"] * 4
    assert snap.view_step == 29 and snap.steps == tuple(range(30))
    r0 = snap.ranks[0]
    assert (r0.step, r0.step_ms, r0.fwd_ms, r0.late_ms) == (29, 100.0, 20.0, 0.0)
    assert r0.cpu_pct == 95.0 and r0.rss_bytes == 300 << 20 and r0.host == "node0"
    assert snap.heatmap is not None and snap.heatmap.collectives == ("b0", "b1", "b2", "b3")
    assert snap.steps_per_s == pytest.approx(10.0)
    assert not [f for f in snap.findings if f.severity != "info"]


def test_a_straggler_is_named_with_its_bucket_lateness(tmp_path: Path) -> None:
    live, snap = feed_all(write_run(tmp_path / "run", world=4, steps=30, straggler=2, end=None))
    assert {r.rank: r.status for r in snap.ranks} == {0: "running", 1: "running", 2: "straggler", 3: "running"}
    f = next(f for f in snap.findings if f.code == "straggler")
    assert f.ranks == [2] and f.severity == "warning" and f.fix
    assert snap.heatmap is not None and (worst := snap.heatmap.worst()) is not None and worst[0] == 2
    assert snap.heatmap.late_ms[2] == pytest.approx((40.0,) * 4)
    assert snap.ranks[2].late_ms == pytest.approx(40.0) and snap.ranks[0].wait_ms == pytest.approx(40.0)
    assert snap.health == "warning"
    # stepping back in time shows that step's numbers
    old = live.snapshot(at_step=5)
    assert old.view_step == 5 and {r.step for r in old.ranks} == {5}


def test_a_straggler_that_starts_mid_run_is_named_within_10_steps(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    source, live = DirSource(d), LiveRun()
    files = {r: open(d / f"rank-{r:05d}.jsonl", "ab") for r in range(4)}  # noqa: SIM115 - closed below
    try:
        records = {r: synthetic_records(r, 4, range(60), straggler=3, straggle_from=30, end=None) for r in range(4)}
        seen_at = None
        for i in range(max(len(v) for v in records.values())):
            for r, recs in records.items():
                if i < len(recs):
                    files[r].write(encode(recs[i]))
                    files[r].flush()
            live.feed(source.poll())
            snap = live.snapshot()
            if seen_at is None and any(f.code == "straggler" for f in snap.findings):
                seen_at = snap.view_step
        assert seen_at is not None and 30 <= seen_at < 40
    finally:
        for f in files.values():
            f.close()


def _feed_steps(
    world: int, steps: int, late_at: Callable[[int], dict[int, float]], step_ms: float = 100.0
) -> list[LiveSnapshot]:
    """Feed a run step by step as the watcher would see it; one snapshot per step."""
    live = LiveRun()
    records = {
        r: synthetic_records(r, world, range(steps), late_at=late_at, end=None, step_ms=step_ms) for r in range(world)
    }
    snaps = []
    for r in range(world):
        live.feed(RankRecord(r, 0, rec) for rec in records[r][:2])  # header, layout
    for i in range(steps):
        live.feed(
            RankRecord(r, 0, rec) for r in range(world) for rec in records[r][2:] if getattr(rec, "step", None) == i
        )
        snaps.append(live.snapshot())
    return snaps


def test_a_periodic_straggler_is_named_live_with_its_period_and_cost() -> None:
    # rank 0 spends 600 ms between steps every 8th step (a checkpoint on rank 0 only): late 4 times
    # in 32 steps; a 10-step window holds at most 2 of them, the live window sees the period
    snaps = _feed_steps(3, 40, lambda step: {0: 600.0} if step % 8 == 7 else {})
    snap = snaps[-1]
    f = next(f for f in snap.findings if f.code == "straggler")
    assert f.ranks == [0] and f.evidence["pattern"] == "periodic" and f.evidence["every_n_steps"] == 8
    assert {r.rank: r.status for r in snap.ranks} == {0: "straggler", 1: "running", 2: "running"}
    # "cost to others": the wall time the run lost for each rank over the window
    lost = {r.rank: r.lost_for_others_ms for r in snap.ranks}
    assert lost[0] == pytest.approx(5 * 600.0) and lost[1] == lost[2] == 0.0
    assert all(r.lost_for_others_ms is None for r in snaps[0].ranks)  # nothing computed before 3 steps


@pytest.mark.parametrize("step_ms, late_ms", [(100.0, 40.0), (1000.0, 150.0)])
def test_a_steady_straggler_is_named_within_10_steps_whatever_the_step_time(step_ms: float, late_ms: float) -> None:
    # on 1 s steps, 150 ms late costs 3% of a 64-step window only after 13 steps: the last 10 name it sooner
    snaps = _feed_steps(4, 90, lambda step: {3: late_ms} if step >= 70 else {}, step_ms=step_ms)
    named = [s.view_step for s in snaps if any(f.code == "straggler" for f in s.findings)]
    assert named and 70 <= named[0] < 80 and all(s.ranks[3].status == "straggler" for s in snaps[named[0] :])
    assert not any(f.code == "straggler" for s in snaps[:70] for f in s.findings)


def test_jitter_that_moves_between_ranks_is_never_blamed() -> None:
    # every step one rank, drawn at random, is up to 15 ms late on a 100 ms step: no straggler, ever
    rng = random.Random(7)
    lates = [{rng.randrange(4): rng.uniform(0.0, 15.0)} for _ in range(150)]
    snaps = _feed_steps(4, 150, lambda step: lates[step])
    assert not [f for s in snaps for f in s.findings if f.code == "straggler"]
    assert all(r.status == "running" for s in snaps for r in s.ranks)
    assert all(r.lost_for_others_ms is not None and r.lost_for_others_ms < 200.0 for r in snaps[-1].ranks)


def test_history_is_bounded(tmp_path: Path) -> None:
    live, snap = feed_all(write_run(tmp_path / "run", world=2, steps=500), history=50)
    assert len(snap.steps) == 50 and snap.steps[-1] == 499
    assert len(snap.step_times) == 50
    assert all(len(st.steps) == 50 for st in live._ranks.values())
    assert len(live._arrivals) <= 50 and not live._pending


def test_hang_status_and_stack(tmp_path: Path) -> None:
    _, snap = feed_all(write_run(tmp_path / "run", world=3, steps=20, hang_at=12))
    # ranks 0 and 1 wait in the all-reduce; rank 2, stalled in its evaluation, is the one missing
    assert {r.rank: r.status for r in snap.ranks} == {0: "hung", 1: "hung", 2: "hung"}
    f = next(f for f in snap.findings if f.code == "hang" and f.severity == "error")
    assert f.ranks == [2] and "evaluate" in f.detail
    assert snap.ranks[2].hang is not None and "evaluate" in snap.ranks[2].hang.stack[-1]
    assert snap.health == "error"
    assert any(f.code == "hang" and f.severity == "error" for f in snap.findings)


def test_failed_terminated_and_lost_ranks(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    for rank, end, steps in ((0, "error: RuntimeError", 30), (1, "signal", 30), (2, None, 10)):
        with open(d / rank_file_name(rank), "wb") as f:
            f.writelines(encode(rec) for rec in synthetic_records(rank, 3, range(steps), end=end))
    _, snap = feed_all(d)
    assert [r.status for r in snap.ranks] == ["failed", "terminated", "lost"]
    assert any(f.code == "rank-lost" and f.ranks == [2] for f in snap.findings)
    assert snap.health == "error" and not snap.finished


def test_snapshot_only_reads(tmp_path: Path) -> None:
    """The detectors run when records are fed; a snapshot (any step, any number of times) changes nothing."""
    for name, kwargs in (
        ("hang", {"world": 3, "steps": 20, "hang_at": 12}),
        ("straggler", {"world": 4, "steps": 30, "straggler": 2, "end": None}),
    ):
        live = LiveRun()
        live.feed(DirSource(write_run(tmp_path / name, **kwargs)).poll())
        findings, lost, hung = dict(live._findings), set(live._lost), set(live._hung)
        assert findings  # the hang, the straggler: found while feeding
        first = live.snapshot()
        for at in (None, 3, 5, None):
            live.snapshot(at)
        assert live._findings == findings and list(live._findings) == list(findings)
        assert (live._lost, live._hung) == (lost, hung)
        assert live.snapshot() == first


def _afresh(live: LiveRun, at_step: int | None = None) -> LiveSnapshot:
    """The snapshot built with nothing kept from earlier snapshots (rows, arrivals, heatmaps)."""
    for st in live._ranks.values():
        st.row = None
    live._forget_views()
    return live.snapshot(at_step)


def test_rows_kept_between_snapshots_are_the_rows_built_afresh() -> None:
    """Snapshots reuse a rank's row while nothing it shows changed: fed a few records at a time
    (a straggler from step 8, a rank that ends early, snapshots between, stepped back too), every
    snapshot equals the one built afresh, the bucket views included."""
    world = 4
    records = {
        r: synthetic_records(r, world, range(24 if r == 3 else 30), straggler=1, straggle_from=8, end="close")
        for r in range(world)
    }
    live, statuses = LiveRun(), set()
    mixed = [
        RankRecord(r, 0, rec) for i in range(40) for r in range(world) if i < len(records[r]) for rec in [records[r][i]]
    ]

    def same(at: int | None = None) -> None:
        kept = live.snapshot(at)
        fresh = _afresh(live, at)
        assert kept == fresh
        assert [r.buckets for r in kept.ranks] == [r.buckets for r in fresh.ranks]
        assert kept.heatmap == fresh.heatmap
        statuses.update(r.status for r in kept.ranks)

    for i in range(0, len(mixed), 3):
        live.feed(mixed[i : i + 3])
        same(5 if 36 <= i < 60 else None)  # stepped back for a while, the run going on meanwhile
        if i == 60:
            for at in (6, 6, 12, None):
                same(at)
    assert {"straggler", "running", "finished"} <= statuses  # (what the run went through)


def test_mismatched_collectives_are_named_once_every_rank_logged_the_step() -> None:
    """Rank 0 ran no buffer broadcast in step 5 (a lone forward took it); rank 2 runs 10 steps
    behind. The step is compared, and the finding named, as soon as rank 2 has logged it too
    (rank 1 logs each step first: rank 2's step 5 agrees with the first seen, rank 0's did not)."""
    records = {r: synthetic_records(r, 3, range(30), end=None) for r in range(3)}
    for r, recs in records.items():
        for rec in recs:
            if isinstance(rec, Step) and not (r == 0 and rec.step == 5):
                rec.bcast_start_us, rec.bcast_us = 500.0, 1000.0
    steps = {r: [rec for rec in records[r] if isinstance(rec, Step)] for r in range(3)}
    live = LiveRun()
    live.feed(RankRecord(r, 0, rec) for r in range(3) for rec in records[r][:2])  # headers, layouts
    named_at = None
    for i in range(30):
        live.feed(RankRecord(r, 0, steps[r][k]) for r, k in ((1, i), (0, i), (2, i - 10)) if k >= 0)
        if named_at is None and any(f.code == "mismatched-collectives" for f in live.snapshot().findings):
            named_at = i
    assert named_at == 15  # rank 2 logged step 5 then
    [f] = [f for f in live.snapshot().findings if f.code == "mismatched-collectives"]
    assert f.ranks == [0] and f.step == 5 and f.evidence["collective"] == "buffer broadcast"


def test_a_data_loading_straggler_is_titled_with_one_pair_of_brackets() -> None:
    """Rank 0 starts every forward 40 ms late (its input pipeline): the phase, "data loading
    (before forward)", is followed by the time lost without a second bracket."""
    records = {r: synthetic_records(r, 3, range(30), late_at=lambda step: {0: 40.0}, end=None) for r in range(3)}
    for rec in records[0]:
        if isinstance(rec, Step):  # late before its forward, not in it: forward and backward take as long
            rec.fwd_start_us += 40_000.0
            rec.fwd_end_us = (rec.fwd_end_us or 0.0) + 40_000.0
    live = LiveRun()
    live.feed(RankRecord(r, 0, rec) for r in range(3) for rec in records[r])
    f = next(f for f in live.snapshot().findings if f.code == "straggler")
    assert f.ranks == [0] and "data loading (before forward)" in f.title
    assert ") (" not in f.title and f.title.endswith(" lost"), f.title


def test_a_straggler_that_dies_is_named_lost_not_a_straggler() -> None:
    """Rank 2 is late at every step, then killed (no end record) while the others go on and
    close: it is lost; the straggler finding it had while alive goes, and no later check names it."""
    records = {r: synthetic_records(r, 3, range(20 if r == 2 else 30), straggler=2, end=None) for r in range(3)}
    ends = {r: synthetic_records(r, 3, range(30), straggler=2)[-1] for r in (0, 1)}
    alive = [RankRecord(r, 0, rec) for r in range(3) for rec in records[r] if getattr(rec, "step", 0) < 20]
    later = [RankRecord(r, 0, rec) for r in (0, 1) for rec in records[r] if getattr(rec, "step", 0) >= 20]
    live = LiveRun()
    live.feed(alive)
    snap = live.snapshot()
    assert [f.ranks for f in snap.findings if f.code == "straggler"] == [[2]] and snap.ranks[2].status == "straggler"
    live.feed([*later, *(RankRecord(r, 0, end) for r, end in ends.items())])
    live.feed([])
    snap = live.snapshot()
    assert {r.rank: r.status for r in snap.ranks} == {0: "finished", 1: "finished", 2: "lost"}
    assert any(f.code == "rank-lost" and f.ranks == [2] for f in snap.findings)
    assert not [f for f in snap.findings if f.code == "straggler"], [f.title for f in snap.findings]


def test_lost_ranks_are_found_when_fed(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    for rank in range(3):
        with open(d / rank_file_name(rank), "wb") as f:
            f.writelines(
                encode(rec)
                for rec in synthetic_records(
                    rank, 3, range(10 if rank == 2 else 30), end=None if rank == 2 else "close"
                )
            )
    live = LiveRun()
    live.feed(DirSource(d).poll())
    assert [k for k in live._findings if k.code == "rank-lost"] == [FindingKey("rank-lost", "cross-rank", (2,))]


def test_garbage_truncation_deletion_and_late_ranks(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    source, live = DirSource(d), LiveRun()
    recs = {r: synthetic_records(r, 3, range(20), end=None) for r in range(3)}
    # ranks 0 and 1 first, with garbage between records and a torn last line
    for r in (0, 1):
        with open(d / f"rank-{r:05d}.jsonl", "wb") as f:
            f.writelines(encode(rec) + b"\x00garbage{not json\n" for rec in recs[r][:12])
            f.write(encode(recs[r][12])[:20])
    live.feed(source.poll())
    live.set_source_health(source.health())
    snap = live.snapshot()
    assert {r.rank for r in snap.ranks} == {0, 1} and snap.world_size == 3
    assert snap.view_step is None  # no step is complete before rank 2 shows up
    assert snap.source.corrupt_lines >= 20
    # rank 2 appears late: earlier steps complete as its records arrive
    with open(d / "rank-00002.jsonl", "wb") as f:
        f.writelines(encode(rec) for rec in recs[2])
    live.feed(source.poll())
    before = live.snapshot().view_step
    assert before is not None
    # rank 1's file is truncated and rewritten: read from the start, nothing counted twice
    with open(d / "rank-00001.jsonl", "wb") as f:
        f.writelines(encode(rec) for rec in recs[1][:5])
    live.feed(source.poll())
    snap = live.snapshot()
    assert snap.ranks[1].step is not None and snap.ranks[1].step <= 5
    assert list(snap.steps) == sorted(set(snap.steps)) and snap.view_step == snap.steps[-1] == before
    # rank 0's file is deleted: the view keeps what it had
    (d / "rank-00000.jsonl").unlink()
    live.feed(source.poll())
    assert live.snapshot().ranks[0].step is not None


def _write_attempt(run_dir: Path, attempt: int, steps: int) -> int:
    """Rank files of one elastic attempt (``attempt-N``, as ``runtime.run_dir`` lays them out)."""
    folder = run_dir / f"attempt-{attempt}"
    folder.mkdir(parents=True)
    written = 0
    for rank in range(2):
        recs = synthetic_records(rank, 2, range(steps), end=None)
        with open(folder / f"rank-{rank:05d}.jsonl", "wb") as f:
            f.writelines(encode(rec) for rec in recs)
        written += len(recs)
    return written


def test_the_dir_source_follows_a_restart_to_the_new_attempt(tmp_path: Path) -> None:
    from ddpdoctor.analysis.live_run import poll_source
    from ddpdoctor.cli.watch_cmd import open_source

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    source = open_source(run_dir, None)  # what `ddpdoctor watch RUN_DIR` tails: the top run dir
    assert isinstance(source, DirSource) and source.attempt is None
    live = LiveRun(label=source.label, attempt=source.attempt)
    live, records = poll_source(live, source)
    assert records == []

    _write_attempt(run_dir, 0, 30)
    first, records = poll_source(live, source)
    assert source.attempt == 0 and source.label == str(run_dir / "attempt-0")
    assert first.attempt == 0 and len(records) > 60
    snap = first.snapshot()
    assert snap.attempt == 0 and snap.view_step == 29 and {r.status for r in snap.ranks} == {"running"}

    # torchrun restarts the workers: attempt-1 appears while we watch, step numbers start over
    written = _write_attempt(run_dir, 1, 5)
    # the old attempt's files grow further (a rank that had not died yet): nothing of it is delivered
    with open(run_dir / "attempt-0" / "rank-00000.jsonl", "ab") as f:
        f.writelines(encode(rec) for rec in synthetic_records(0, 2, range(30, 40), header=False, end=None))
    second, records = poll_source(first, source)
    assert source.attempt == 1 and source.label == str(run_dir / "attempt-1")
    assert len(records) == written and all(not isinstance(rr.record, Step) or rr.record.step < 5 for rr in records)
    assert second is not first and second.attempt == 1  # a fresh live state: attempts never mix
    snap = second.snapshot()
    assert snap.attempt == 1 and snap.steps == (0, 1, 2, 3, 4) and snap.view_step == 4
    assert snap.records == written and [r.step for r in snap.ranks] == [4, 4]
    # and it goes on tailing the new attempt
    with open(run_dir / "attempt-1" / "rank-00001.jsonl", "ab") as f:
        f.writelines(encode(rec) for rec in synthetic_records(1, 2, range(5, 7), header=False, end=None))
    third, records = poll_source(second, source)
    assert third is second and len(records) == 2 and third.snapshot().latest_step == 6


# -- a real 2-rank gloo run, watched while it trains ------------------------------------------------------


def delayed_rank_training(rank: int, world_size: int, run_dir: str, healthy_steps: int, slow_steps: int) -> int:
    """Rank 1 becomes slow in backward after ``healthy_steps`` steps."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpdoctor
    from tests.models import DelayNet, batches

    torch.manual_seed(0)
    net = DelayNet()
    ddp = DDP(net, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    with ddpdoctor.instrument(ddp, run_dir=run_dir):
        for i, (x, y) in enumerate(batches(rank, healthy_steps + slow_steps)):
            if rank == 1 and i == healthy_steps:
                net.backward_s = 0.12
            loss = ((ddp(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return rank


@pytest.mark.slow
def test_live_view_names_a_real_straggler_within_10_steps(tmp_path: Path) -> None:
    from tests.ddp_harness import run_ranks

    healthy, slow = 12, 16
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            run_ranks(delayed_rank_training, 2, args=(str(run_dir), healthy, slow), timeout=180)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    source, live = DirSource(run_dir), LiveRun()
    seen_at = None
    tick = threading.Event()
    deadline = time.monotonic() + 200
    try:
        while time.monotonic() < deadline:
            live.feed(source.poll())
            snap = live.snapshot()
            # the first view after the slowdown began in which rank 1 is named (a loaded machine
            # may have made a rank lag before: that does not count for or against)
            if (
                seen_at is None
                and snap.view_step is not None
                and snap.view_step >= healthy
                and len(snap.ranks) == 2
                and snap.ranks[1].status == "straggler"
            ):
                seen_at = snap.view_step
            if not trainer.is_alive() and snap.finished:
                break
            tick.wait(0.1)  # the poll rate of the UI's watcher
    finally:
        trainer.join(timeout=200)
    assert not errors, errors
    assert snap.finished
    # a finished rank's row reads its last step with a duration (the last one's end would have
    # come from a next forward)
    assert all(r.step_ms is not None and r.step_ms > 0 for r in snap.ranks), [(r.step, r.step_ms) for r in snap.ranks]
    f = next(f for f in snap.findings if f.code == "straggler" and f.ranks == [1])
    assert f.evidence["phase"] == "backward"
    assert seen_at is not None and healthy <= seen_at < healthy + 10, seen_at


def test_the_hang_as_seen_now_replaces_the_first_watchdogs_view() -> None:
    """Rank 1 skipped a backward and waits in step 4's buffer broadcast; rank 0 waits in step 3's
    all-reduce. Rank 1's watchdog reports first: alone, it makes rank 0 look missing. Once rank
    0's record arrives, the one hang finding names rank 1, and the first view is gone."""
    live = LiveRun()
    records = {r: synthetic_records(r, 2, range(3), end=None) for r in range(2)}
    live.feed(RankRecord(r, 0, rec) for r in range(2) for rec in records[r])

    def stalled(rank: int, step: int, phase: str, bucket: int | None) -> RankRecord:
        at = T0_NS + 400_000_000
        hang = Hang(
            rank=rank,
            t_mono_ns=at - T0_NS,
            t_wall_ns=at,
            step=step,
            phase=phase,
            pending_bucket=bucket,
            waited_s=2.0,
            buckets=4,
            stack=["train.py:40 in main"],
        )
        return RankRecord(rank, 0, hang)

    live.feed([stalled(1, 4, "buffer broadcast", None)])
    first = [f for f in live.snapshot().findings if f.code == "hang"]
    assert [(f.severity, f.ranks) for f in first] == [("error", [0])]  # as far as rank 1 can tell
    live.feed([stalled(0, 3, "allreduce", 0)])
    snap = live.snapshot()
    hangs = [f for f in snap.findings if f.code == "hang"]
    assert [(f.severity, f.ranks) for f in hangs] == [("error", [1])], [f.title for f in hangs]
    assert {r.rank: r.status for r in snap.ranks} == {0: "hung", 1: "hung"}
    live.feed([])  # the same view again: the same single entry
    assert [f.code for f in live.snapshot().findings].count("hang") == 1


@pytest.mark.slow
def test_live_view_names_a_real_hang_while_the_job_is_hung(tmp_path: Path) -> None:
    """tests/scripts/skip_a_backward.py: rank 1 skips one backward, the job hangs; the watchdogs fire."""
    import os
    import subprocess
    import sys

    from tests.ddp_harness import free_port

    script = Path(__file__).parent / "scripts" / "skip_a_backward.py"
    run_dir = tmp_path / "run"
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(run_dir), "2.0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_PORT=str(port)),
        )
        for r in range(2)
    ]
    tick = threading.Event()
    try:
        deadline = time.monotonic() + 120
        while not run_dir.exists():
            assert time.monotonic() < deadline, "the ranks never created the run dir"
            tick.wait(0.05)
        source, live = DirSource(run_dir), LiveRun()
        finding = None
        while finding is None:
            assert time.monotonic() < deadline, "no hang finding naming where rank 1 is"
            assert all(p.poll() is None for p in procs), "a rank exited: the job must hang"
            live.feed(source.poll())
            snap = live.snapshot()
            finding = next(
                (
                    f
                    for f in snap.findings
                    if f.code == "hang"
                    and f.severity == "error"
                    and "stack" in f.evidence.get("missing", {}).get(1, {})
                ),
                None,
            )
            tick.wait(0.1)
        assert finding.ranks == [1]
        assert {r.rank: r.status for r in snap.ranks} == {0: "hung", 1: "hung"}
        stalled = snap.ranks[1].hang
        assert stalled is not None and any("skip_a_backward.py" in line for line in stalled.stack)
        assert snap.health == "error"
        assert [f.code for f in snap.findings].count("hang") == 1  # rank 0's own hang finding gave way
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
