"""A rank file's own line index: the sampled read through it gives what a full scan gives, on
whole, torn, restarted and tampered logs, and every reader skips the index lines."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bench.synth import rank_records
from ddpdoctor.events import Header, Record, Step, line_index
from ddpdoctor.events.line_index import INDEX_PREFIX
from ddpdoctor.runlog.indexed import file_lines, scanned
from ddpdoctor.runlog.rank_file import RankFileTail, RankLog, _read_sampled, read_sampled
from ddpdoctor.sinks import FileSink

MAX_STEPS = 512
#: An index line every 64 KiB of records: many index lines from a few thousand steps.
EVERY = 64 << 10


@pytest.fixture(autouse=True)
def small_index_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(line_index, "INDEX_EVERY_BYTES", EVERY)


def records(steps: int, pid: int = 1000, bare: range = range(0)) -> Iterator[Record]:
    """A synthetic rank's records; the steps in ``bare`` without any bucket (a skipped backward)."""
    for r in rank_records(0, 4, steps, buckets=8):
        if isinstance(r, Header):
            r = msgspec.structs.replace(r, pid=pid)
        elif isinstance(r, Step) and r.step in bare:
            r = msgspec.structs.replace(r, b_ready_us=[], b_launch_us=[], b_done_us=[], b_bytes=[])
        yield r


def write(path: Path, recs: Iterator[Record]) -> None:
    """Through the writer, in batches as a training rank's come (a flush every 200 records)."""
    sink = FileSink(path)
    for i, r in enumerate(recs):
        sink.emit(r)
        if i % 200 == 199:
            assert sink.flush(timeout=30)
    sink.close(timeout=60)
    assert sink.dropped == 0


def by_scan(path: Path) -> RankLog:
    """What the reader makes of the file without its index (as it reads an older log)."""
    lines, torn = scanned(path, path.read_bytes())
    return _read_sampled(lines, torn, path, 0, 0, MAX_STEPS, None)


def summary(log: RankLog) -> dict[str, Any]:
    return {
        "steps": log.steps,
        "steps_total": log.steps_total,
        "stride": log.step_stride,
        "bare": log.bare_steps,
        "headers": log.headers,
        "procs": log.procs,
        "fingerprints": log.fingerprints,
        "unused": log.unused,
        "end": log.end,
        "corrupt": log.corrupt_lines,
        "unknown": log.unknown_lines,
        "torn": log.torn_tail,
        "jobs": log.earlier_jobs,
        "windows": log.windows,
        "full": log.full_steps,
    }


def indexed_lines(path: Path) -> int:
    """Lines the index describes (the others the reader scans)."""
    found = file_lines(path)
    assert found is not None, "the file has no index"
    lines = found[0]
    return len(lines) - len(lines._held)


def test_the_index_read_equals_the_scan_and_covers_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rank-00000.jsonl"
    write(path, records(4000, bare=range(3000, 3100)))
    assert path.read_bytes().count(b"\n" + INDEX_PREFIX) >= 3  # several index lines, chained
    got = read_sampled(path, 0, 0, MAX_STEPS)
    assert summary(got) == summary(by_scan(path))
    assert got.bare_steps[:3] == [3000, 3001, 3002] and len(got.bare_steps) == 100
    assert got.steps_total == 4000 and got.end is not None and got.unknown_lines == 0
    found = file_lines(path)
    assert found is not None and not found[0]._held  # every line from the index: nothing scanned


def test_a_live_tail_skips_the_index_lines(tmp_path: Path) -> None:
    path = tmp_path / "rank-00000.jsonl"
    write(path, records(1500))
    tail = RankFileTail(path, 0, 0)
    tail.poll(final=True)
    assert INDEX_PREFIX in path.read_bytes()
    assert (tail.log.unknown_lines, tail.log.corrupt_lines, tail.log.steps_total) == (0, 0, 1500)


@pytest.mark.parametrize("cut", [0.99, 0.7, 0.3])
def test_a_log_cut_mid_record_reads_as_the_scan_reads_it(tmp_path: Path, cut: float) -> None:
    """A crash tears the last line (and leaves the last index line unwritten): the index covers
    what it covers, the rest is scanned, the torn line is counted once."""
    path = tmp_path / "rank-00000.jsonl"
    write(path, records(3000))
    data = path.read_bytes()
    at = data.rindex(b'"step":', 0, int(len(data) * cut))  # in the middle of a record
    path.write_bytes(data[:at])
    got = read_sampled(path, 0, 0, MAX_STEPS)
    assert got.torn_tail and got.corrupt_lines == 1
    assert summary(got) == summary(by_scan(path))
    if cut < 0.5:
        assert indexed_lines(path) > 0  # the lines before the cut still come from the index


def test_a_restarted_rank_that_appended_reads_as_the_scan_reads_it(tmp_path: Path) -> None:
    """A rank's process crashed mid-record and another process of it appended to the same log:
    the new writer ends the torn line first, chains its index to the old one, and the reader
    reads the last process (the earlier one counted), its header whole."""
    path = tmp_path / "rank-00000.jsonl"
    write(path, records(3000, pid=1))
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b'"step":', int(len(data) * 0.8))])
    write(path, records(2500, pid=2, bare=range(10, 20)))
    got = read_sampled(path, 0, 0, MAX_STEPS)
    assert summary(got) == summary(by_scan(path))
    assert got.earlier_jobs == 1 and got.headers and got.headers[0].pid == 2
    assert got.steps_total == 2500 and got.bare_steps == list(range(10, 20))
    whole = RankFileTail(path, 0, 0)
    whole.poll(final=True)
    assert whole.log.corrupt_lines == 1 and whole.log.earlier_jobs == 1  # the torn line alone: the header is whole
    assert indexed_lines(path) > 0.9 * (path.read_bytes().count(b"\n") - whole.log.corrupt_lines)


def test_an_old_log_without_an_index_is_appended_to_and_read(tmp_path: Path) -> None:
    """A log an older ddpdoctor wrote (no index), then a process that indexes: the unindexed part
    is scanned, the rest read through the index."""
    path = tmp_path / "rank-00000.jsonl"
    write(path, records(2000, pid=1))
    path.write_bytes(
        b"".join(line + b"\n" for line in path.read_bytes().splitlines() if not line.startswith(INDEX_PREFIX))
    )
    write(path, records(2000, pid=2))
    assert summary(read_sampled(path, 0, 0, MAX_STEPS)) == summary(by_scan(path))
    assert indexed_lines(path) > 0


def test_an_index_that_does_not_match_the_file_falls_back_to_the_scan(tmp_path: Path) -> None:
    """A file edited after it was written (a line made longer): the index points into the middle
    of lines; the reader notices and scans instead, losing nothing."""
    path = tmp_path / "rank-00000.jsonl"
    write(path, records(3000))
    data = path.read_bytes()
    at = data.index(b'{"kind":"proc"', len(data) // 3)
    path.write_bytes(data[:at] + b'{"kind":"proc","rank":0,"t_mono_ns":1,"t_wall_ns":1}\n' + data[at:])
    got = read_sampled(path, 0, 0, MAX_STEPS)
    assert summary(got) == summary(by_scan(path))
    os.truncate(path, path.stat().st_size)  # (unchanged: the comparison above is the check)
