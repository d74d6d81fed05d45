"""The detectors on hand-made records: the edges the zoo scripts do not reach."""

from __future__ import annotations

import msgspec

from ddpdoctor.analysis.accumulation import sync_during_accumulation
from ddpdoctor.analysis.buffers import (
    allreduce_bound_ms,
    buffer_broadcast_cost,
    constant_buffers,
    cross_rank_floor_ms,
)
from ddpdoctor.analysis.diagnose import merge
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.replicas import compare_fingerprints
from ddpdoctor.analysis.requires_grad import stale_requires_grad
from ddpdoctor.events import BufferInfo, Fingerprint, GradFlags, Header, ParamInfo, Step

HEADER = Header(
    rank=0,
    ddp_options={"find_unused_parameters": False},
    params=[
        ParamInfo(name="a", shape=[10], dtype="float32", numel=10, requires_grad=True),
        ParamInfo(name="b", shape=[5], dtype="float16", numel=5, requires_grad=True),
    ],
    buffers=[
        BufferInfo(name="table", shape=[4], dtype="float32", bytes=16, broadcast=True, version=0),
        BufferInfo(name="stat", shape=[4], dtype="float32", bytes=16, broadcast=True, version=0),
    ],
)


def _step(i: int, opt: bool = True, bcast: float | None = None, end: float = 10_000.0) -> Step:
    return Step(
        rank=0,
        step=i,
        t0_mono_ns=0,
        t0_wall_ns=0,
        b_ready_us=[100.0],
        b_done_us=[200.0],
        b_bytes=[64],
        sync_end_us=200.0,
        opt_start_us=300.0 if opt else None,
        opt_end_us=400.0 if opt else None,
        bcast_us=bcast,
        bcast_bytes=32 if bcast else 0,
        end_us=end,
    )


def test_frozen_is_an_error_without_find_unused_and_counts_bytes() -> None:
    flags = [GradFlags(rank=0, step=4, frozen=["b"]), GradFlags(rank=0, step=6, frozen=["b", "a"])]
    (f,) = stale_requires_grad(HEADER, flags, rank=0)
    assert (f.code, f.severity, f.step) == ("frozen-after-wrap", "error", 4)
    assert f.evidence["names"] == ["b", "a"] and f.evidence["bytes_per_step"] == 5 * 2 + 10 * 4


def test_thawed_back_leaves_no_finding() -> None:
    assert stale_requires_grad(HEADER, [GradFlags(rank=0, step=2)], rank=0) == []


def test_accumulation_needs_optimizer_records_and_a_majority() -> None:
    assert sync_during_accumulation([_step(i, opt=False) for i in range(8)], 0) == []  # no torch.optim: unknown
    assert sync_during_accumulation([_step(i) for i in range(8)], 0) == []  # one backward per step: fine
    steps = [_step(i, opt=i % 4 == 3) for i in range(16)]
    (f,) = sync_during_accumulation(steps, 0)
    assert f.evidence["backwards_per_optimizer_step"] == 4 and f.evidence["optimizer_steps"] == 4


def test_broadcast_cost_uses_the_floor_not_the_waits() -> None:
    # a rank that always waits 5 ms inside the broadcast for the other: the transfer is 0.1 ms
    waiting = [_step(i, bcast=5000.0) for i in range(20)]
    arriving_last = [_step(i, bcast=100.0) for i in range(20)]
    cost = cross_rank_floor_ms({0: waiting, 1: arriving_last})
    assert cost == 0.1
    assert buffer_broadcast_cost(HEADER, waiting, 0, cost_ms=cost) == []  # 1% of the step: nothing to say
    # alone, the waiting rank's floor is 5 ms; its own all-reduce moved 64 B in 0.1 ms, so 32 B of
    # buffers cost at most 0.2 ms: the rest was waiting (a late data loader on the other rank)
    assert allreduce_bound_ms(waiting, 32) == 0.2
    assert buffer_broadcast_cost(HEADER, waiting, 0) == []
    # without a bucket timed end to end, nothing bounds the floor: this rank can only see its own
    untimed = [msgspec.structs.replace(s, b_done_us=[]) for s in waiting]
    (f,) = buffer_broadcast_cost(HEADER, untimed, 0)
    assert f.severity == "warning" and not f.evidence["capped_by_allreduce"]


def _bound_one_bucket_at_a_time(steps: list[Step], nbytes: int) -> float | None:
    """``allreduce_bound_ms`` as the plain loop over every bucket of every step computes it."""
    best = None
    for s in steps:
        if s.summary or not s.b_done_us:
            continue
        for start, done, size in zip(s.b_launch_us or s.b_ready_us, s.b_done_us, s.b_bytes, strict=False):
            if start is None or done is None or not size:
                continue
            ms = (done - start) / 1000.0 * max(1.0, nbytes / size)
            if best is None or ms < best:
                best = ms
    return None if best is None else best * 2.0


def test_the_broadcast_bound_equals_the_plain_loop_over_every_bucket() -> None:
    """The bound read a step's buckets in C-level calls, bucket by bucket only where a step has a
    None: on windows of every kind (untimed buckets, no launch column, a bucket of no size, summary
    steps, columns of unequal length, a layout shared or not), the same value to the last bit."""
    import random

    rng = random.Random(7)
    shared = [4096, 512, 64, 1 << 20]
    for trial in range(300):
        steps = []
        for i in range(rng.randint(0, 12)):
            n = rng.randint(0, 5)
            ready = [rng.uniform(0, 5000) for _ in range(n)]
            launch = [r + rng.uniform(0, 3000) for r in ready] if rng.random() < 0.7 else []
            done = [(launch or ready)[b] + rng.uniform(0.5, 4000) for b in range(n)]
            if rng.random() < 0.2 and n:
                done[rng.randrange(n)] = None
            if rng.random() < 0.1 and launch:
                launch[rng.randrange(n)] = None
            sizes = shared[:n] if rng.random() < 0.5 else [rng.choice([0, 32, 8192, 1 << 16]) for _ in range(n)]
            if rng.random() < 0.1 and n:
                done = done[:-1]  # (a bucket not seen: the columns' lengths differ)
            steps.append(
                msgspec.structs.replace(
                    _step(i),
                    b_ready_us=ready,
                    b_launch_us=launch,
                    b_done_us=done,
                    b_bytes=sizes,
                    summary=rng.random() < 0.1,
                )
            )
        for nbytes in (0, 16, 50_000, 1 << 22):
            bound = _bound_one_bucket_at_a_time(steps, nbytes)
            assert allreduce_bound_ms(steps, nbytes) == bound, (trial, nbytes)
            # asked only whether it is under a value: the same answer, found sooner where it is
            for below in (0.01, 0.5, 5.0, 500.0):
                got = allreduce_bound_ms(steps, nbytes, enough_below=below)
                if bound is None or bound >= below:
                    assert got == bound, (trial, nbytes, below)
                else:
                    assert got is not None and bound <= got < below, (trial, nbytes, below)


def test_the_broadcast_bound_over_a_sliding_window_reads_each_step_once_and_gives_the_same() -> None:
    """The live checks' memo of each step's value: windows of 100 steps every 50, the buffers'
    bytes changing once, records replaced by equal ones: every call's value as without it, and a
    step's buckets read again only where its value could differ."""
    import random

    from ddpdoctor.analysis.buffers import TransferMemo

    rng = random.Random(3)
    steps = []
    for i in range(400):
        ready = [rng.uniform(0, 5000) for _ in range(3)]
        done = [r + rng.uniform(50, 4000) for r in ready]
        sizes = [64, 8, 4096]
        steps.append(msgspec.structs.replace(_step(i), b_ready_us=ready, b_launch_us=[], b_done_us=done, b_bytes=sizes))
    memo = TransferMemo(200)
    read = 0
    for end in range(50, 401, 50):
        window = steps[max(0, end - 100) : end]
        nbytes = 32 if end < 250 else 1 << 16
        if end == 300:  # an equal record in another object: read anew
            window[-1] = msgspec.structs.replace(window[-1])
        before = len(memo.values_for(nbytes))
        assert allreduce_bound_ms(window, nbytes, memo=memo) == _bound_one_bucket_at_a_time(window, nbytes), end
        read += len(memo.values_for(nbytes)) - before
    assert len(memo.values_for(1 << 16)) <= 200
    assert read < 400 + 100  # each step read once, the window read again once at the change of bytes


def test_broadcast_cost_bound_scales_with_the_buffers_bytes() -> None:
    # 64 KiB of buffers against 64 B buckets all-reduced in 0.1 ms: the bound (2 x 0.1 ms x 1024)
    # is far above the 5 ms floor, which stands: a real cost is still reported
    heavy = [msgspec.structs.replace(_step(i, bcast=5000.0), bcast_bytes=65536) for i in range(20)]
    assert allreduce_bound_ms(heavy, 65536) == 204.8
    (f,) = buffer_broadcast_cost(HEADER, heavy, 0)
    assert (f.severity, f.evidence["broadcast_ms"], f.evidence["capped_by_allreduce"]) == ("warning", 5.0, False)
    # a rank that waited in every broadcast of those bytes: capped at the bound, said in the detail
    slow = [msgspec.structs.replace(s, bcast_us=500_000.0, end_us=1_000_000.0) for s in heavy]
    (f,) = buffer_broadcast_cost(HEADER, slow, 0)
    assert f.evidence["broadcast_ms"] == 204.8 and f.evidence["capped_by_allreduce"]
    assert "waited in every broadcast" in f.detail


def test_constant_buffers_need_both_version_and_values_unchanged() -> None:
    prints = [
        Fingerprint(rank=0, step=s, buffer_norms=[1.0, float(s)], buffer_sums=[2.0, float(s)], buffer_versions=[0, 0])
        for s in (0, 1, 3, 5)
    ]
    (f,) = constant_buffers(HEADER, prints, [_step(i, bcast=500.0) for i in range(6)], 0)
    assert f.evidence["names"] == ["table"]  # "stat" kept its version but its values moved
    assert "_set_params_and_buffers_to_ignore_for_model" in f.fix and "TrainingArguments" not in f.fix
    still = [msgspec.structs.replace(p, buffer_norms=[1.0, 0.0], buffer_sums=[2.0, 0.0]) for p in prints]
    (every,) = constant_buffers(HEADER, still, [_step(i, bcast=500.0) for i in range(6)], 0)
    assert every.evidence["names"] == ["table", "stat"] and "broadcast_buffers=False" in every.fix
    # six broadcasts timed: the saving is a bound (the live check's first look), ten: a figure
    assert every.evidence["broadcasts_timed"] == 6 and "would save up to 0.20 ms per step" in every.detail
    (later,) = constant_buffers(HEADER, still, [_step(i, bcast=500.0) for i in range(10)], 0)
    assert "would save about 0.20 ms per step" in later.detail and "start-up" not in later.detail
    # where a framework wraps the model, the user never calls DDP: its own switch is named too
    assert "TrainingArguments(ddp_broadcast_buffers=False)" in every.fix
    # the exact bits, where the log has them, see a change below the float values' resolution
    moved = [msgspec.structs.replace(p, buffer_bits=[7, p.step]) for p in still]
    (f,) = constant_buffers(HEADER, moved, [_step(i, bcast=500.0) for i in range(6)], 0)
    assert f.evidence["names"] == ["table"]


def test_replicas_are_compared_by_their_bits_where_the_logs_have_them() -> None:
    def fp(rank: int, bits: int) -> Fingerprint:  # float sums apart (another thread count), bits equal
        return Fingerprint(
            rank=rank, step=5, param_norms=[1.0, 1.0], param_sums=[1.0 + rank, 1.0], param_bits=[bits, 9]
        )

    assert compare_fingerprints(HEADER, {0: [fp(0, 3)], 1: [fp(1, 3)]}) == []
    (f,) = compare_fingerprints(HEADER, {0: [fp(0, 3)], 1: [fp(1, 4)]})
    assert (f.evidence["names"], "last bits" in f.detail) == (["a"], True)
    old = {r: [msgspec.structs.replace(fp(r, 3), param_bits=[])] for r in (0, 1)}  # a schema 2 log
    assert compare_fingerprints(HEADER, old)[0].evidence["names"] == ["a"]


def test_replica_comparison_names_the_odd_rank_out() -> None:
    def fp(rank: int, a: float) -> Fingerprint:
        return Fingerprint(rank=rank, step=5, param_norms=[a, 1.0], param_sums=[a, 1.0])

    (f,) = compare_fingerprints(HEADER, {0: [fp(0, 1.0)], 1: [fp(1, 1.0)], 2: [fp(2, 1.5)]})
    assert (f.code, f.ranks, f.evidence["names"], f.step) == ("replica-divergence", [2], ["a"], 5)
    (tie,) = compare_fingerprints(HEADER, {0: [fp(0, 1.0)], 1: [fp(1, 1.5)]})
    assert tie.ranks == [0, 1]  # two ranks: which one is wrong cannot be told


def test_merge_unites_ranks_and_keeps_the_worst() -> None:
    a = Finding(code="x", severity="info", title="t", detail="d", fix="f", ranks=[1], step=9, evidence={"names": ["p"]})
    b = Finding(
        code="x", severity="error", title="T", detail="D", fix="F", ranks=[0], step=3, evidence={"names": ["q"]}
    )
    (m,) = merge([a, b])
    assert (m.severity, m.ranks, m.step, m.title, m.evidence["names"]) == ("error", [0, 1], 3, "T", ["p", "q"])


def test_exposed_communication_by_share_of_step() -> None:
    from ddpdoctor.analysis.straggler import exposed_communication

    def step(i: int, exposed_us: float) -> Step:
        return Step(
            rank=0,
            step=i,
            t0_mono_ns=0,
            t0_wall_ns=0,
            fwd_end_us=10_000.0,
            bwd_end_us=50_000.0,
            b_ready_us=[20_000.0, 49_000.0],
            b_done_us=[30_000.0, 50_000.0 + exposed_us],
            sync_end_us=50_000.0 + exposed_us,
            end_us=100_000.0,
        )

    assert exposed_communication([step(i, 5_000.0) for i in range(6)], 0) == []  # 5%: hidden enough
    (f,) = exposed_communication([step(i, 40_000.0) for i in range(6)], 0)
    assert f.severity == "warning" and f.evidence["exposed_ms"] == 40.0 and 0 < f.evidence["overlap_ratio"] < 1
    tiny = [
        Step(
            rank=0,
            step=i,
            t0_mono_ns=0,
            t0_wall_ns=0,
            fwd_end_us=300.0,
            bwd_end_us=1000.0,
            b_ready_us=[900.0],
            b_done_us=[2500.0],
            sync_end_us=2500.0,
            end_us=3000.0,
        )
        for i in range(6)
    ]
    (small,) = exposed_communication(tiny, 0)  # half of a 3 ms step, but 1.5 ms: the latency floor, info
    assert small.severity == "info" and small.evidence["share_of_step"] == 0.5


def test_a_straggler_of_part_of_a_run_is_named_with_its_steps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import ddpdoctor
    from tests.test_live_run import write_run

    def stragglers(**kwargs: object) -> list[Finding]:
        run = ddpdoctor.load_run(write_run(tmp_path / str(len(list(tmp_path.iterdir()))), world=4, steps=300, **kwargs))
        return [f for f in ddpdoctor.analyze(run).findings if f.code == "straggler"]

    # slow for 60 of 300 steps: the whole-run test (latest in 60% of the steps) cannot name it
    late = stragglers(straggler=2, straggle_from=200, straggle_until=260)
    assert len(late) == 1 and late[0].ranks == [2] and late[0].severity == "warning"
    # windows of 30 steps find it (210-269); the period is then moved to the slow steps themselves
    assert late[0].evidence["period"] == [200, 259] and late[0].step == 200
    assert "by 40.0 ms in steps 200 to 259: backward" in late[0].title

    # slow from step 240 to the end: a period that closes with the run
    tail = stragglers(straggler=1, straggle_from=240)
    assert len(tail) == 1 and tail[0].ranks == [1] and tail[0].evidence["period"] == [240, 299]

    # slow all along: the whole-run finding alone (no period on top of it); healthy: nothing
    whole = stragglers(straggler=3)
    assert len(whole) == 1 and "period" not in whole[0].evidence and "in steps" not in whole[0].title
    assert stragglers() == []
