"""Reading runs back: torn and corrupt lines are counted, never fatal; bad dirs are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

import ddpdoctor
from ddpdoctor.events import Header, Step, encode
from ddpdoctor.runlog import RankFileTail, RunDirError, load_run


def _write(path: Path, *chunks: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        for c in chunks:
            f.write(c)


def _header(rank: int, world: int = 2) -> bytes:
    return encode(Header(rank=rank, world_size=world, backend="gloo"))


def _step(rank: int, i: int) -> bytes:
    return encode(Step(rank=rank, step=i, t0_mono_ns=i * 1000, t0_wall_ns=i * 1000, end_us=10.0))


def test_torn_last_line_and_corrupt_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    _write(tmp_path / "rank-00000.jsonl", _header(0), _step(0, 0), b"\x00garbage{{\n", _step(0, 1),
           b'{"kind":"from-the-future","rank":0}\n', _step(0, 2), _step(0, 3)[:25])
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


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "absent", "no such directory"),
    (lambda p: (p / "f.jsonl").write_text("x") and p / "f.jsonl", "not a directory"),
    (lambda p: p, "no rank files"),
])
def test_bad_run_dirs_are_clear_errors(tmp_path: Path, make: object, message: str) -> None:
    with pytest.raises(RunDirError, match=message):
        load_run(make(tmp_path))  # type: ignore[operator]


def test_tail_reads_a_growing_file_and_holds_back_a_partial_line(tmp_path: Path) -> None:
    path = tmp_path / "rank-00000.jsonl"
    _write(path, _header(0))
    tail = RankFileTail(path, 0, 0)
    assert [type(r) for r in tail.poll()] == [Header]
    line = _step(0, 0)
    _write(path, line[:10])
    assert tail.poll() == []  # partial: wait for the rest
    _write(path, line[10:], _step(0, 1))
    assert [r.step for r in tail.poll()] == [0, 1]
    assert tail.log.corrupt_lines == 0


def test_tail_starts_over_when_the_file_is_truncated_or_deleted(tmp_path: Path) -> None:
    path = tmp_path / "rank-00000.jsonl"
    _write(path, _header(0), _step(0, 0), _step(0, 1))
    tail = RankFileTail(path, 0, 0)
    assert len(tail.poll()) == 3
    path.write_bytes(_step(0, 7))  # truncated and rewritten, shorter than before
    assert [r.step for r in tail.poll()] == [7]
    path.unlink()
    assert tail.poll() == []
