"""Sinks: the background file writer, its flush bound, and errors that lose nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ddpdoctor.events import End, Record, Step, decode
from ddpdoctor.events.line_index import is_index_line
from ddpdoctor.sinks import FileSink, MemorySink, NullSink, SinkError
from ddpdoctor.sinks.file import FLUSH_INTERVAL_S


def _step_no(record: Record) -> int:
    assert isinstance(record, Step)
    return record.step


def _step(i: int) -> Step:
    return Step(rank=3, step=i, t0_mono_ns=i, t0_wall_ns=i, b_ready_us=[1.0, 2.0], b_done_us=[3.0, 4.0])


def _lines(path: Path) -> list[bytes]:
    """The record lines (the file's own index lines left out)."""
    return [line for line in path.read_bytes().split(b"\n") if line and not is_index_line(line)]


def test_file_sink_writes_json_lines_in_order_and_closes(tmp_path: Path) -> None:
    sink = FileSink(tmp_path / "run" / "rank-00003.jsonl", mode="full")  # every record as it came
    for i in range(1000):
        sink.emit(_step(i))
    sink.emit(End(rank=3, t_mono_ns=0, t_wall_ns=0, steps=1000, reason="close"))
    sink.close()
    records = [decode(line) for line in _lines(tmp_path / "run" / "rank-00003.jsonl")]
    assert [_step_no(r) for r in records[:-1]] == list(range(1000))
    assert isinstance(records[-1], End)
    sink.emit(_step(5))  # after close: dropped, no error


def test_file_sink_reaches_disk_within_the_flush_interval_without_close(tmp_path: Path) -> None:
    path = tmp_path / "rank-00000.jsonl"
    sink = FileSink(path)
    try:
        start = time.monotonic()
        sink.emit(_step(0))
        deadline = start + 5.0
        while time.monotonic() < deadline and not _lines(path):
            time.sleep(0.01)  # polling the file with a deadline, not sleeping as synchronization
        elapsed = time.monotonic() - start
        assert _lines(path), "record never reached the file"
        assert elapsed < FLUSH_INTERVAL_S + 0.5
    finally:
        sink.close()


def test_flush_makes_everything_durable_at_once(tmp_path: Path) -> None:
    path = tmp_path / "rank-00000.jsonl"
    sink = FileSink(path, flush_interval=60.0, mode="full")
    try:
        for i in range(10):
            sink.emit(_step(i))
        assert sink.flush(timeout=5.0)
        assert len(_lines(path)) == 10
    finally:
        sink.close()


def test_unwritable_location_is_a_clear_sink_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SinkError, match="cannot open .*file/run/rank-00000.jsonl"):
        FileSink(blocker / "run" / "rank-00000.jsonl")


def test_memory_and_null_sinks() -> None:
    mem = MemorySink()
    mem.emit(_step(1))
    mem.emit(End(rank=3, t_mono_ns=0, t_wall_ns=0, steps=1, reason="close"))
    assert [type(r) for r in mem.records] == [Step, End]
    assert len(mem.of_kind(Step)) == 1
    mem.close()
    mem.emit(_step(2))
    assert len(mem.records) == 2
    NullSink().emit(_step(1))
    assert NullSink().flush() is True


def test_emit_many_keeps_order_bound_and_close_like_emit(tmp_path: Path) -> None:
    """The recorder hands closed steps over in batches (``emit_many``): the file gets them in
    order among single records, a full queue drops the newest and counts them, and a closed
    sink drops without an error."""
    path = tmp_path / "rank-00003.jsonl"
    sink = FileSink(path, flush_interval=3600.0, mode="full")  # the writer waits for flush
    try:
        sink.emit_many([_step(0), _step(1)])
        sink.emit(End(rank=3, t_mono_ns=0, t_wall_ns=0, steps=2, reason="close"))
        sink.max_pending = 6  # 3 queued: room for 3 of the next 5
        sink.emit_many([_step(i) for i in range(2, 7)])
        assert sink.dropped == 2
        assert sink.flush(timeout=10.0)
        records = [decode(line) for line in _lines(path)]
        assert [type(r).__name__ for r in records] == ["Step", "Step", "End", "Step", "Step", "Step"]
        assert [_step_no(r) for r in records if isinstance(r, Step)] == [0, 1, 2, 3, 4]
    finally:
        sink.close()
    sink.emit_many([_step(9)])  # after close: dropped, no error
    assert len(_lines(path)) == 6


def test_emit_many_of_the_memory_and_null_sinks() -> None:
    memory = MemorySink()
    memory.emit(_step(0))
    memory.emit_many([_step(1), _step(2)])
    assert [_step_no(r) for r in memory.records] == [0, 1, 2]
    memory.close()
    memory.emit_many([_step(3)])
    assert len(memory.records) == 3
    NullSink().emit_many([_step(0)])


class _DuckSink:
    """A sink of a user's: ``emit``, ``flush`` and ``close``, not a ``Sink`` (no ``emit_many``)."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def emit(self, record: Record) -> None:
        self.records.append(record)

    def flush(self, timeout: float = 5.0) -> bool:
        return True

    def close(self, timeout: float = 5.0) -> None:
        return None


def _train_into_a_duck_sink(rank: int, world_size: int) -> tuple[list[int], list[str]]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpdoctor
    from ddpdoctor.events import ProbeOff
    from tests.models import make_model

    sink = _DuckSink()
    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    with ddpdoctor.instrument(ddp, sink=sink):  # type: ignore[arg-type]
        for _ in range(40):  # more than a batch of closed steps
            opt.zero_grad()
            ddp(torch.randn(8, 32)).sum().backward()
            opt.step()
    steps = [r.step for r in sink.records if isinstance(r, Step)]
    return steps, [r.probe for r in sink.records if isinstance(r, ProbeOff)]


def test_a_sink_without_emit_many_still_gets_every_step() -> None:
    from tests.ddp_harness import run_ranks

    (result,) = run_ranks(_train_into_a_duck_sink, 1, timeout=120)
    steps, probes_off = result
    assert steps == list(range(40)) and probes_off == []
