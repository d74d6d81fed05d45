"""The report's advice on hand-made records: the first compared step where replicas
differed, a static unused set, the buffer-broadcast verdict, the communication predictions."""

from __future__ import annotations

from pathlib import Path

from ddpdoctor.analysis.buffers import advise_broadcast, broadcast_redundancy
from ddpdoctor.analysis.comm_advice import advise_communication
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.replicas import compare_fingerprints
from ddpdoctor.analysis.unused import static_unused_set
from ddpdoctor.events import BufferInfo, Fingerprint, Header, ParamInfo, Step, Unused
from ddpdoctor.runlog import Run

HEADER = Header(
    rank=0,
    ddp_options={"find_unused_parameters": True},
    params=[
        ParamInfo(name="a", shape=[10], dtype="float32", numel=10, requires_grad=True),
        ParamInfo(name="aux", shape=[5], dtype="float32", numel=5, requires_grad=True),
    ],
    buffers=[
        BufferInfo(name="counter", shape=[1], dtype="float32", bytes=4, broadcast=True, version=0, checksum=0.0),
        BufferInfo(name="running_mean", shape=[4], dtype="float32", bytes=16, broadcast=True, version=0, checksum=0.0),
        BufferInfo(name="table", shape=[4], dtype="float32", bytes=16, broadcast=True, version=0, checksum=8.0),
    ],
)


def _steps(n: int) -> list[Step]:
    return [Step(rank=0, step=i, t0_mono_ns=0, t0_wall_ns=0, end_us=10_000.0) for i in range(n)]


def test_divergence_names_the_first_compared_step_and_the_last_identical_one() -> None:
    def fp(rank: int, step: int) -> Fingerprint:
        drift = 0.01 * rank if step >= 7 else 0.0  # the ranks drift apart after step 5
        return Fingerprint(rank=rank, step=step, param_norms=[1.0 + drift, 2.0], param_sums=[3.0 + drift, 4.0])

    schedule = [0, 1, 3, 7, 15, 30]  # dense early, then the final fingerprint at close
    (f,) = compare_fingerprints(HEADER, {r: [fp(r, s) for s in schedule] for r in (0, 1)})
    assert f.code == "replica-divergence" and f.step == 7
    assert f.evidence["first_step"] == 7 and f.evidence["last_equal_step"] == 3
    assert f.evidence["compared_steps"] == schedule and f.evidence["names"] == ["a"]
    assert "from step 7" in f.title and "identical at step 3" in f.detail and "between step 3 and step 7" in f.detail
    # different at the very first comparison: no identical step to name
    (g,) = compare_fingerprints(HEADER, {r: [fp(r, 7 + s) for s in (0, 8)] for r in (0, 1)})
    assert g.evidence["last_equal_step"] is None and "the first step compared" in g.detail


def test_broadcast_buffers_copied_between_forwards_are_not_divergence() -> None:
    after = {
        r: [
            Fingerprint(
                rank=r,
                step=3,
                param_norms=[1.0, 1.0],
                param_sums=[1.0, 1.0],
                buffer_norms=[1.0, 1.0, 1.0],
                buffer_sums=[1.0, 1.0, 1.0],
                after_broadcast=True,
            )
        ]
        for r in (0, 1)
    }
    final = {
        r: [
            Fingerprint(
                rank=r,
                step=30,
                param_norms=[1.0, 1.0],
                param_sums=[1.0, 1.0],
                buffer_norms=[1.0, 1.0 + r, 1.0],
                buffer_sums=[1.0, 1.0 + r, 1.0],
            )
        ]
        for r in (0, 1)
    }
    prints = {r: after[r] + final[r] for r in (0, 1)}
    assert compare_fingerprints(HEADER, prints) == []  # the next forward's broadcast puts them back in step


def _unused(step: int, names: list[str]) -> Unused:
    return Unused(rank=0, step=step, names=names, post_forward_us=300.0)


def test_static_unused_set_suggests_static_graph_with_the_search_cost() -> None:
    samples = [_unused(s, ["aux"]) for s in (0, 1, 3, 7, 15)]
    (f,) = static_unused_set(HEADER, samples, _steps(16), 0)
    assert f.code == "find-unused-unneeded" and f.severity == "warning"  # 0.3 ms of a 10 ms step
    assert f.evidence["post_forward_ms"] == 0.3 and f.evidence["share_of_step"] == 0.03
    assert f.evidence["names"] == ["aux"] and "static_graph=True" in f.fix


def test_a_changing_unused_set_gets_no_static_advice() -> None:
    samples = [_unused(s, ["aux"] if s % 2 else []) for s in (0, 1, 3, 7, 15, 16)]
    assert static_unused_set(HEADER, samples, _steps(17), 0) == []
    static = Header(rank=0, ddp_options={"find_unused_parameters": True, "static_graph": True}, params=HEADER.params)
    assert static_unused_set(static, [_unused(s, ["aux"]) for s in (1, 3, 7)], _steps(8), 0) == []
    plain = Header(rank=0, ddp_options={"find_unused_parameters": False}, params=HEADER.params)
    assert static_unused_set(plain, [_unused(s, ["aux"]) for s in (1, 3, 7)], _steps(8), 0) == []


def _final(rank: int, counter: float, mean: float, after: bool = False) -> Fingerprint:
    return Fingerprint(
        rank=rank,
        step=30,
        buffer_norms=[counter, mean, 4.0],
        buffer_sums=[counter, mean, 8.0],
        buffer_versions=[30, 0, 0],
        after_broadcast=after,
    )


COST = Finding(
    code="buffer-broadcast-cost",
    severity="warning",
    title="t",
    detail="d",
    fix="f",
    ranks=[0, 1],
    step=0,
    evidence={"broadcast_ms": 2.0},
)


def test_buffers_identical_outside_the_broadcast_make_it_redundant() -> None:
    verdict = broadcast_redundancy(HEADER, {0: [_final(0, 30.0, 0.0)], 1: [_final(1, 30.0, 0.0)]})
    assert verdict is not None and verdict["redundant"] and verdict["changing"] == ["counter"]  # table never moved
    f = advise_broadcast(COST, verdict)
    assert f.evidence["broadcast_redundant"] is True and f.evidence["predicted_saving_ms"] == 2.0
    assert "redundant" in f.detail and "broadcast_buffers=False" in f.fix
    # a model wrapped by a framework: its own switch for the same thing (the user never calls DDP)
    assert "TrainingArguments(ddp_broadcast_buffers=False)" in f.fix and "DDPStrategy(broadcast_buffers=False)" in f.fix


def test_buffers_that_differ_outside_the_broadcast_make_turning_it_off_unsafe() -> None:
    verdict = broadcast_redundancy(HEADER, {0: [_final(0, 30.0, 0.5)], 1: [_final(1, 30.0, 0.7)]})
    assert verdict is not None and not verdict["redundant"] and verdict["would_drift"] == ["running_mean"]
    f = advise_broadcast(COST, verdict)
    assert "unsafe" in f.detail and "Keep broadcast_buffers=True" in f.fix and f.evidence["predicted_saving_ms"] is None
    # copies taken right after the broadcast say nothing about it
    assert broadcast_redundancy(HEADER, {r: [_final(r, 30.0, 0.5 + r, after=True)] for r in (0, 1)}) is None


def test_communication_advice_without_samples_halves_the_exposed_time() -> None:
    exposed = Finding(
        code="exposed-communication",
        severity="warning",
        title="t",
        detail="d.",
        fix="f",
        ranks=[0, 1],
        step=0,
        evidence={"exposed_ms": 10.0, "allreduce_ms": 14.0, "step_ms": 30.0},
    )
    f = advise_communication(Run(dir=Path(".")), exposed)
    assert f.evidence["predicted"]["compress_hook_step_ms"] == 23.0  # 30 - min(10, 14 / 2)
    assert "bf16_compress_hook" in f.fix and "23.0 ms" in f.detail
    info = Finding(**{**exposed.to_dict(), "severity": "info"})
    assert advise_communication(Run(dir=Path(".")), info) is info  # not communication-bound
