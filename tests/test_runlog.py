"""Reading runs back: torn and corrupt lines are counted, never fatal; bad dirs are clear errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import ddpdoctor
from ddpdoctor.events import Header, Record, Step, encode
from ddpdoctor.events.layout import rank_file_name
from ddpdoctor.runlog import RankFileTail, RunDirError, load_run


def _write(path: Path, *chunks: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        for c in chunks:
            f.write(c)


def _header(rank: int, world: int = 2) -> bytes:
    return encode(Header(rank=rank, world_size=world, backend="gloo"))


def _step_no(record: Record) -> int:
    assert isinstance(record, Step)
    return record.step


def _step(rank: int, i: int) -> bytes:
    return encode(Step(rank=rank, step=i, t0_mono_ns=i * 1000, t0_wall_ns=i * 1000, end_us=10.0))


def test_torn_last_line_and_corrupt_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    _write(
        tmp_path / "rank-00000.jsonl",
        _header(0),
        _step(0, 0),
        b"\x00garbage{{\n",
        _step(0, 1),
        b'{"kind":"from-the-future","rank":0}\n',
        _step(0, 2),
        _step(0, 3)[:25],
    )
    _write(tmp_path / "rank-00001.jsonl", _header(1), _step(1, 0), _step(1, 1))
    run = load_run(tmp_path)
    log = run.ranks[0]
    assert [s.step for s in log.steps] == [0, 1, 2]
    assert log.corrupt_lines == 2 and log.torn_tail and log.unknown_lines == 1
    assert run.corrupt_lines == 2 and run.unknown_lines == 1
    report = ddpdoctor.analyze(run).to_dict()
    assert report["run"]["corrupt_lines"] == 2
    assert report["ranks"][0]["corrupt_lines"] == 2 and report["ranks"][0]["torn_tail"] is True


def test_missing_rank_file_is_reported_not_fatal(tmp_path: Path) -> None:
    _write(tmp_path / "rank-00000.jsonl", _header(0, world=3), _step(0, 0))
    _write(tmp_path / "rank-00002.jsonl", _header(2, world=3), _step(2, 0))
    run = load_run(tmp_path)
    assert run.missing_ranks() == [1]
    assert ddpdoctor.analyze(run).to_dict()["run"]["missing_ranks"] == [1]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "absent", "no such directory"),
        (lambda p: (p / "f.jsonl").write_text("x") and p / "f.jsonl", "not a directory"),
        (lambda p: p, "no rank files"),
    ],
)
def test_bad_run_dirs_are_clear_errors(tmp_path: Path, make: Callable[[Path], Path], message: str) -> None:
    with pytest.raises(RunDirError, match=message):
        load_run(make(tmp_path))


def test_tail_reads_a_growing_file_and_holds_back_a_partial_line(tmp_path: Path) -> None:
    path = tmp_path / "rank-00000.jsonl"
    _write(path, _header(0))
    tail = RankFileTail(path, 0, 0)
    assert [type(r) for r in tail.poll()] == [Header]
    line = _step(0, 0)
    _write(path, line[:10])
    assert tail.poll() == []  # partial: wait for the rest
    _write(path, line[10:], _step(0, 1))
    assert [_step_no(r) for r in tail.poll()] == [0, 1]
    assert tail.log.corrupt_lines == 0


def test_tail_starts_over_when_the_file_is_truncated_or_deleted(tmp_path: Path) -> None:
    path = tmp_path / "rank-00000.jsonl"
    _write(path, _header(0), _step(0, 0), _step(0, 1))
    tail = RankFileTail(path, 0, 0)
    assert len(tail.poll()) == 3
    path.write_bytes(_step(0, 7))  # truncated and rewritten, shorter than before
    assert [_step_no(r) for r in tail.poll()] == [7]
    path.unlink()
    assert tail.poll() == []


def _write_synth(run_dir: Path, ranks: int, steps: int, straggler: int | None = None, mode: str = "compact") -> None:
    from bench.synth import rank_records
    from ddpdoctor.sinks import FileSink

    for rank in range(ranks):
        sink = FileSink(run_dir / f"rank-{rank:05d}.jsonl", mode=mode)
        for record in rank_records(rank, ranks, steps, straggler=straggler):
            sink.emit(record)
        sink.close()


@pytest.mark.parametrize("mode", ["compact", "full"])
def test_a_sampled_load_keeps_the_same_steps_on_every_rank_and_counts_all(tmp_path: Path, mode: str) -> None:
    _write_synth(tmp_path, 3, 3000, straggler=2, mode=mode)
    with (tmp_path / "rank-00001.jsonl").open("ab") as f:
        f.write(b'garbage\n{"kind": "step", "rank": 1, "step": 3000, "t0_mo')  # garbage, then a torn tail
    run = load_run(tmp_path, max_steps=256)
    kept = {r: [s.step for s in log.steps] for r, log in run.ranks.items()}
    # the smallest power of two that keeps <= 256 of 3000 (a compact log: <= 128, and 128 full
    # records; with more windows than a quarter of the budget, <= 64: one window decoded a step)
    stride = 16 if mode == "full" else 64
    assert run.ranks[0].step_stride == stride
    assert kept[0] == kept[1] == kept[2]  # comparable step by step
    # on the stride, the last ones, and (compact log) the full records: per-bucket detail is kept
    off_stride = [s for s in run.ranks[0].steps if s.step % stride and s.step < 3000 - 128]
    assert kept[0][-128:] == list(range(2872, 3000))
    assert all(not s.summary for s in off_stride) and (len(off_stride) > 0) == (mode == "compact")
    assert [log.steps_total for log in run.ranks.values()] == [3000] * 3
    assert run.ranks[1].corrupt_lines == 2 and run.ranks[1].torn_tail
    full = load_run(tmp_path)
    assert len(run.ranks[0].fingerprints) == len(full.ranks[0].fingerprints) == 62  # all non-step records kept
    assert sum(len(log.steps) for log in full.ranks.values()) == 9000
    report = ddpdoctor.analyze(run)
    assert report.run["steps_sampled_every"] == stride and report.ranks[0]["steps"] == 3000
    [straggler] = [f for f in report.findings if f.code == "straggler"]
    assert straggler.ranks == [2] and straggler.evidence["phase"] == "backward"
    assert [f.code for f in report.findings] == ["straggler"]


def test_bare_steps_are_remembered_even_when_sampled(tmp_path: Path) -> None:
    header = Header(rank=0, world_size=1)
    steps = [Step(rank=0, step=i, t0_mono_ns=i, t0_wall_ns=i, b_ready_us=[] if i == 37 else [1.0]) for i in range(600)]
    records: list[Record] = [header, *steps]
    (tmp_path / rank_file_name(0)).write_bytes(b"".join(encode(r) for r in records))
    assert load_run(tmp_path, max_steps=64).ranks[0].bare_steps == [37]
    assert load_run(tmp_path).ranks[0].bare_steps == [37]


def test_steps_with_unmarked_buckets_are_read_back_not_dropped(tmp_path: Path) -> None:
    """Per-bucket lists hold null for a bucket not seen (a step closed mid-backward) or not marked
    (a CUDA step between the sampled ones): such a step is read like any other. Until the
    schema's element types said so, the reader dropped it as an unknown record."""
    partial = Step(
        rank=0,
        step=1,
        t0_mono_ns=0,
        t0_wall_ns=0,
        clock="cuda",
        b_ready_us=[1000.0, None, 3000.0],
        b_launch_us=[1000.0, None, 3000.0],
        b_bytes=[64, 64, 64],
        bwd_end_us=3100.0,
        sync_end_us=4000.0,
        end_us=5000.0,
    )
    _write(tmp_path / "rank-00000.jsonl", _header(0), _step(0, 0), encode(partial), _step(0, 2))
    log = load_run(tmp_path).ranks[0]
    assert [s.step for s in log.steps] == [0, 1, 2] and log.unknown_lines == 0
    (read,) = [s for s in log.steps if s.step == 1]
    assert read == partial and read.ready_span_us() == (1000.0, 3000.0) and not read.per_bucket()
