"""The compact log: full step records at sampled steps and around incidents, windows elsewhere;
read back, it gives the same steps (to the µs), the same findings, at a fraction of the bytes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

import ddpdoctor
from ddpdoctor.events import SCHEMA_VERSION, FindingRecord, Record, Step, Window, decode
from ddpdoctor.events.layout import LOG_MODE_ENV, rank_file_name
from ddpdoctor.runlog import DirSource, load_run
from ddpdoctor.sinks import FileSink, Sink
from ddpdoctor.sinks.compact import AFTER, FIRST_FULL, RING, WINDOW_ROWS, WINDOW_S, Compactor
from ddpdoctor.sinks.file import FLUSH_INTERVAL_S
from tests.ddp_harness import run_ranks

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _write(run_dir: Path, records_of: Any, ranks: int, mode: str) -> None:
    for rank in range(ranks):
        sink = FileSink(run_dir / rank_file_name(rank), mode=mode)
        for record in records_of(rank):
            sink.emit(record)
        sink.close()
        assert not sink.dropped


def _synth(ranks: int, steps: int, straggler: int | None = None) -> Any:
    from bench.synth import rank_records

    return lambda rank: rank_records(rank, ranks, steps, straggler=straggler)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines() if line]  # what jq sees


def _full_steps(path: Path) -> list[int]:
    return [r["step"] for r in _lines(path) if r["kind"] == "step"]


def test_a_compact_log_reads_back_as_the_full_log(tmp_path: Path) -> None:
    _write(tmp_path / "full", _synth(3, 700, straggler=2), 3, "full")
    _write(tmp_path / "compact", _synth(3, 700, straggler=2), 3, "compact")
    full, compact = load_run(tmp_path / "full"), load_run(tmp_path / "compact")
    for rank in range(3):
        a, b = full.ranks[rank], compact.ranks[rank]
        assert b.windows > 0 and b.steps_total == a.steps_total == 700
        assert [s.step for s in a.steps] == [s.step for s in b.steps] == list(range(700))
        for x, y in zip(a.steps, b.steps, strict=True):
            if not y.summary:
                assert x == y  # a full record is the runtime's record, as it was
                continue
            assert abs(x.t0_mono_ns - y.t0_mono_ns) <= 500 and abs(x.t0_wall_ns - y.t0_wall_ns) <= 1000
            for name in ("fwd_start_us", "fwd_us", "bcast_start_us", "fwd_end_us", "bwd_end_us", "sync_end_us"):
                assert getattr(y, name) == pytest.approx(getattr(x, name), abs=0.5)
            assert y.ready_span_us() == pytest.approx(x.ready_span_us(), abs=0.5)
            assert y.bucket_count() == x.bucket_count() and y.bucket_bytes() == x.bucket_bytes()
        lines = _lines(tmp_path / "compact" / rank_file_name(rank))
        assert lines[0]["kind"] == "header" and lines[0]["schema"] == SCHEMA_VERSION == 3
        for w in (r for r in lines if r["kind"] == "window"):
            assert all(len(w[c]) == w["n"] for c in ("t0", "fwd", "bwd_end", "ready_first", "sync_end", "end"))
    # the findings and the statistics do not depend on what the file kept
    ra, rb = ddpdoctor.analyze(full), ddpdoctor.analyze(compact)
    assert [(f.code, f.ranks) for f in ra.findings] == [(f.code, f.ranks) for f in rb.findings] == [("straggler", [2])]
    assert ra.findings[0].evidence["time_lost_ms"] == pytest.approx(rb.findings[0].evidence["time_lost_ms"], rel=0.01)
    for name, value in ra.stats["median_ms"].items():
        assert rb.stats["median_ms"][name] == pytest.approx(value, abs=0.01), name


def test_a_long_healthy_run_costs_at_most_150_bytes_per_rank_step(tmp_path: Path) -> None:
    _write(tmp_path, _synth(2, 3000), 2, "compact")
    size = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert size / (2 * 3000) <= 150
    assert len(_full_steps(tmp_path / rank_file_name(0))) < 3000 / 40  # first steps and sampled steps only


def test_incidents_keep_the_steps_around_them_in_full(tmp_path: Path) -> None:
    from bench.synth import rank_records

    def records(rank: int) -> Any:
        for r in rank_records(rank, 1, 600):
            if isinstance(r, Step) and r.step == 420:
                r.end_us = (r.end_us or 0.0) * 4  # a step four times slower than the others
            yield r
            if isinstance(r, Step) and r.step == 210:
                yield FindingRecord(
                    rank=rank, step=210, code="unused-parameters", severity="warning", title="t", detail="d", fix="f"
                )

    _write(tmp_path, records, 1, "compact")
    full = set(_full_steps(tmp_path / rank_file_name(0)))
    assert set(range(FIRST_FULL)) <= full and {50, 100, 550} <= full  # the first steps, the sampled ones
    assert set(range(211 - RING, 211 + AFTER)) <= full  # the ring before the finding, and after it
    assert set(range(421 - RING, 421 + AFTER)) <= full  # around the slow step
    assert not full & {201, 222, 301, 401, 411, 430}  # and nothing else
    log = load_run(tmp_path).ranks[0]
    assert [s.step for s in log.steps] == list(range(600))
    assert not log.steps[420].summary and log.steps[420].b_ready_us  # per-bucket detail where it happened


def test_a_step_after_a_gap_in_the_step_numbers_is_kept(tmp_path: Path) -> None:
    """A step whose number does not follow the last one's (a step the runtime never closed) closes
    the window before it and starts the next: it must not be lost between the two."""
    from bench.synth import rank_records

    gone = {60, 130, 131}

    def records(rank: int) -> Any:
        return (r for r in rank_records(rank, 1, 300) if not (isinstance(r, Step) and r.step in gone))

    _write(tmp_path, records, 1, "compact")
    log = load_run(tmp_path).ranks[0]
    assert [s.step for s in log.steps] == [i for i in range(300) if i not in gone]
    assert {61, 132} - set(_full_steps(tmp_path / rank_file_name(0)))  # rows of a window, not full records


def test_log_mode_full_writes_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOG_MODE_ENV, "full")
    sink = FileSink(tmp_path / rank_file_name(0))
    assert sink.mode == "full" and sink.compactor is None
    for r in _synth(1, 100)(0):
        sink.emit(r)
    sink.close()
    assert _full_steps(tmp_path / rank_file_name(0)) == list(range(100))


def test_a_version_1_log_still_reads(tmp_path: Path) -> None:
    """A run written before the compact log (schema 1: a step record per step) reads as it did."""
    run = load_run(FIXTURES / "v1-run")
    assert sorted(run.ranks) == [0, 1]
    for log in run.ranks.values():
        assert log.header is not None and log.header.schema == 1 and log.windows == 0
        assert [s.step for s in log.steps] == list(range(40)) and all(not s.summary for s in log.steps)
    sampled = load_run(FIXTURES / "v1-run", max_steps=8)
    assert sampled.ranks[0].step_stride == 8 and sampled.ranks[0].steps_total == 40
    report = ddpdoctor.analyze(run)
    assert report.run["log_schema"] == 1
    assert [f.code for f in report.findings] == ["straggler"]


def test_a_live_tail_sees_window_rows_within_the_window_time(tmp_path: Path) -> None:
    """``ddpdoctor watch`` tails files: a window reaches the file at most WINDOW_S after its first row."""
    from bench.synth import rank_records

    path = tmp_path / rank_file_name(0)
    sink = FileSink(path)
    source = DirSource(tmp_path)
    try:
        for r in rank_records(0, 1, 40, end=False):
            if isinstance(r, Step):  # 1 ms steps: 40 of them fill no window, only its time closes it
                r = msgspec.structs.replace(r, t0_mono_ns=r.step * 1_000_000)
            sink.emit(r)
        start = time.monotonic()
        seen: list[int] = []
        while time.monotonic() - start < WINDOW_S + 5 and len(seen) < 40:
            seen += [rr.record.step for rr in source.poll() if isinstance(rr.record, Step)]
            time.sleep(0.02)  # polling the file with a deadline, not sleeping as synchronization
        elapsed = time.monotonic() - start
        assert seen == list(range(40))
        assert elapsed <= WINDOW_S + FLUSH_INTERVAL_S + 1.0
        assert any(isinstance(decode(line), Window) for line in path.read_bytes().splitlines())
    finally:
        sink.close()
        source.close()


def test_window_rows_are_bounded(tmp_path: Path) -> None:
    _write(tmp_path, _synth(1, 2000), 1, "compact")
    windows = [r for r in _lines(tmp_path / rank_file_name(0)) if r["kind"] == "window"]
    assert windows and max(w["n"] for w in windows) <= WINDOW_ROWS
    # a window closes at the row that reaches WINDOW_S of the rank's clock (89 ms synthetic steps)
    assert max(sum(w["t0"][:-1]) for w in windows) < WINDOW_S * 1e6 <= max(sum(w["t0"]) for w in windows)


# -- a real run ------------------------------------------------------------------------------------

STEPS = 160
SLOW_STEP = 100


class _BothLogs(Sink):
    """The same records to a compact and a full log: one run, read back both ways."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.sinks = [FileSink(run_dir / mode / rank_file_name(rank), mode=mode) for mode in ("compact", "full")]

    def emit(self, record: Record) -> None:
        for sink in self.sinks:
            sink.emit(record)

    def flush(self, timeout: float = 5.0) -> bool:
        return all([sink.flush(timeout) for sink in self.sinks])

    def close(self, timeout: float = 5.0) -> None:
        for sink in self.sinks:
            sink.close(timeout)


def both_logs_run(rank: int, world_size: int, tmp: str) -> None:
    """Rank 1 is 15 ms slow in backward at every step, and 150 ms more at ``SLOW_STEP``."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    ddp = DDP(model, bucket_cap_mb=0.02)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    step = {"i": 0}

    def delay(grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.015 + (0.15 if step["i"] == SLOW_STEP else 0.0))
        return grad

    if rank == 1:
        model[-1].weight.register_hook(delay)
    gen = torch.Generator().manual_seed(rank)
    with ddpdoctor.instrument(ddp, sink=_BothLogs(Path(tmp), rank)):
        for i in range(STEPS):
            step["i"] = i
            loss = ddp(torch.randn(8, 64, generator=gen)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_a_real_run_gives_the_same_findings_from_its_compact_log(tmp_path: Path) -> None:
    run_ranks(both_logs_run, 2, (str(tmp_path),), timeout=240)
    compact, full = load_run(tmp_path / "compact"), load_run(tmp_path / "full")
    for rank in (0, 1):
        path = tmp_path / "compact" / rank_file_name(rank)
        kept = set(_full_steps(path))
        assert compact.ranks[rank].windows > 0 and len(kept) < STEPS / 2
        assert set(range(SLOW_STEP - 2, SLOW_STEP + 3)) <= kept  # both ranks: the slow step, in full, and around it
        assert [s.step for s in compact.ranks[rank].steps] == [s.step for s in full.ranks[rank].steps]
        # the steps kept as window rows cost a fraction of their full records; how many steps are
        # kept in full depends on the host's jitter (a loaded host's slow steps are incidents too),
        # so the file's size is weighed against the full records of the steps it did not keep
        full_lines = [
            (line, json.loads(line)) for line in (tmp_path / "full" / rank_file_name(rank)).read_bytes().splitlines()
        ]
        dropped = sum(len(line) + 1 for line, r in full_lines if r["kind"] == "step" and r["step"] not in kept)
        rows = sum(len(line) + 1 for line in path.read_bytes().splitlines() if json.loads(line)["kind"] == "window")
        assert rows < dropped / 3, (rows, dropped)
        assert path.stat().st_size < 0.75 * sum(len(line) + 1 for line, _ in full_lines), len(kept)
    ra, rb = ddpdoctor.analyze(full), ddpdoctor.analyze(compact)
    assert ("straggler", [1]) in [(f.code, f.ranks) for f in ra.findings]
    assert [(f.code, f.severity, f.ranks) for f in ra.findings] == [(f.code, f.severity, f.ranks) for f in rb.findings]
    for a, b in zip(ra.findings, rb.findings, strict=True):
        assert a.step == b.step
    lost = [f.evidence["time_lost_ms"] for r in (ra, rb) for f in r.findings if f.code == "straggler"]
    assert lost[1] == pytest.approx(lost[0], rel=0.02)


def log_option_run(rank: int, world_size: int, tmp: str) -> None:
    """Two models in one process group, one per ``log`` option value (none: the default)."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    for mode in ("full", None):
        torch.manual_seed(0)
        ddp = DDP(nn.Linear(8, 8))
        with ddpdoctor.instrument(ddp, run_dir=Path(tmp) / str(mode), log=mode):
            for _ in range(24):
                ddp(torch.randn(4, 8)).sum().backward()


def test_the_log_option_picks_what_the_file_keeps(tmp_path: Path) -> None:
    run_ranks(log_option_run, 2, (str(tmp_path),), timeout=180)
    for rank in (0, 1):
        full = _lines(tmp_path / "full" / rank_file_name(rank))
        compact = _lines(tmp_path / "None" / rank_file_name(rank))
        assert [r["step"] for r in full if r["kind"] == "step"] == list(range(24))
        assert not any(r["kind"] == "window" for r in full)
        kept = [r["step"] for r in compact if r["kind"] == "step"]
        rows = [r["step"] + i for r in compact if r["kind"] == "window" for i in range(r["n"])]
        assert {*range(FIRST_FULL), 15} <= set(kept) and rows  # (a noisy host may add incidents)
        assert sorted(set(kept) | set(rows)) == list(range(24))
        headers = [r for r in full + compact if r["kind"] == "header"]
        assert [h["schema"] for h in headers] == [SCHEMA_VERSION] * 2


# -- the extension's arithmetic (Compactor.accelerate): the bytes Python writes -------------------


def _compacted(records: list[Record], extension: Any = None) -> tuple[bytes, Compactor]:
    from ddpdoctor.events import encode_into

    compactor = Compactor()
    if extension is not None:
        compactor.accelerate(extension)
    out: list[Record] = []
    for record in records:
        compactor.feed(record, out)
    compactor.drain(out)
    buf = bytearray()
    for record in out:
        encode_into(record, buf)
    return bytes(buf), compactor


def _column(extension: Any, values: list[float | None]) -> Any:
    """A ``Column`` of ``values`` (µs), as the extension's record build makes them."""
    from ddpdoctor.runtime.step.recorder import OpenStep

    step = OpenStep(0, 0)
    step.t0_mono_ns, step.t0_wall_ns = 0, 0
    step.ready = [None if v is None else round(v * 1000) for v in values]
    step.launch, step.done, step.nbytes = list(step.ready), list(step.ready), [8] * len(values)
    return extension.build_step(step, Step, 0, 0, "host").b_ready_us


def _planted(extension: Any, seed: int) -> list[Record]:
    """Synthetic records with everything a window row can hold: Columns and lists, None phases,
    micro-steps, wall-clock jumps, half-µs ties, slow steps, bare steps, gaps, ints for floats."""
    import random

    import msgspec

    from bench.synth import rank_records

    rnd = random.Random(seed)
    out: list[Record] = []
    for r in rank_records(1, 2, 900, straggler=1):
        if isinstance(r, Step):
            if r.step in (300, 301, 640):
                continue  # gaps
            kind = rnd.random()
            changes: dict[str, Any] = {}
            if kind < 0.5:
                changes["b_ready_us"] = _column(extension, list(r.b_ready_us))
            if 0.5 <= kind < 0.55:
                changes["b_ready_us"] = [None if i % 3 == 0 else v for i, v in enumerate(r.b_ready_us)]
            if 0.55 <= kind < 0.6:
                changes["b_ready_us"] = _column(extension, [None, *list(r.b_ready_us)[1:]])
            if 600 <= r.step < 620:
                changes["b_ready_us"], changes["b_bytes"] = [], []  # bare steps: a key of their own
            if rnd.random() < 0.1:
                changes["fwd_us"] = None
            if 400 <= r.step < 450:
                changes["opt_start_us"] = changes["opt_end_us"] = None  # a column of None alone
            if rnd.random() < 0.05:
                changes["micro"] = rnd.randint(1, 3)
            if rnd.random() < 0.05:
                changes["t0_wall_ns"] = r.t0_wall_ns + rnd.randint(-5_000_000, 5_000_000)  # NTP steps
            if rnd.random() < 0.1:
                changes["fwd_start_us"] = rnd.randint(0, 9) + 0.5  # ties: rounded to even
            if rnd.random() < 0.02:
                changes["end_us"] = (r.end_us or 0.0) * 5  # slow
            if rnd.random() < 0.02:
                changes["fwd_end_us"] = int(r.fwd_end_us or 0)  # an int where a float is usual
            r = msgspec.structs.replace(r, **changes)
        out.append(r)
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_the_extension_compacts_to_the_bytes_python_writes(native_extension: Any, seed: int) -> None:
    records = _planted(native_extension, seed)
    python, plain = _compacted(records)
    native, fast = _compacted(records, native_extension)
    assert native == python
    assert fast.windows == plain.windows > 10 and fast.full_steps == plain.full_steps > 40
    assert plain._columns is None and fast._columns is native_extension.window_columns  # (both ways ran)


def test_window_columns_in_cpp_are_python_s_or_left_to_it(native_extension: Any) -> None:
    import random

    import msgspec

    from ddpdoctor.sinks import compact

    rnd = random.Random(7)
    base = Step(rank=0, step=0, t0_mono_ns=5_000_000_123_456, t0_wall_ns=1_800_000_000_000_000_000)
    for _ in range(200):
        rows = []
        for i in range(rnd.randint(1, 12)):
            value = lambda: rnd.choice([None, rnd.uniform(-50, 5e4), rnd.randint(0, 99) + 0.5, -0.5, 0.0])  # noqa: E731
            ready = [value() for _ in range(rnd.randint(0, 5))]
            rows.append(
                msgspec.structs.replace(
                    base,
                    step=i,
                    t0_mono_ns=base.t0_mono_ns + i * rnd.randint(0, 3_000_999),
                    t0_wall_ns=base.t0_wall_ns + rnd.randint(-3_000, 3_000),
                    micro=rnd.choice([0, 0, 2]),
                    fwd_start_us=rnd.choice([0.0, 1.5, 2.5]),
                    fwd_us=value(),
                    bcast_start_us=value(),
                    bcast_us=value(),
                    fwd_end_us=value(),
                    bwd_end_us=value(),
                    b_ready_us=ready if rnd.random() < 0.5 else _column(native_extension, ready),
                    sync_end_us=value(),
                    opt_start_us=value(),
                    opt_end_us=value(),
                    end_us=value(),
                )
            )
        assert native_extension.window_columns(rows) == compact.window_columns(rows)
    # what it does not take it leaves to Python (None), and window_of does it there
    odd = [msgspec.structs.replace(base, b_ready_us=[1, 2.5]), msgspec.structs.replace(base, fwd_us=float("nan"))]
    assert native_extension.window_columns(odd[:1]) is None
    huge = [base, msgspec.structs.replace(base, step=1, t0_mono_ns=2**70)]  # (past int64: Python's ints)
    assert native_extension.window_columns(huge) is None
    assert compact.window_of(huge, (0, 0, 0, "host", 0), native_extension.window_columns).t0[1] > 2**60
    assert compact.window_of(odd[:1], (2, 0, 0, "host", 0), native_extension.window_columns).ready_first == [1]
    with pytest.raises(ValueError):  # round(nan), as Python raises it: the writer then writes steps in full
        native_extension.window_columns(odd[1:])
    with pytest.raises(TypeError):
        native_extension.window_columns([])


def test_judge_phases_in_cpp_is_python_s(native_extension: Any) -> None:
    import random

    import msgspec

    from ddpdoctor.sinks import compact

    rnd = random.Random(11)
    base = Step(rank=0, step=0, t0_mono_ns=1, t0_wall_ns=1)
    for _ in range(500):
        value = lambda: rnd.choice([None, rnd.uniform(0, 100), rnd.randint(0, 100), float("nan")])  # noqa: E731
        s = msgspec.structs.replace(
            base,
            end_us=value(),
            fwd_start_us=rnd.uniform(0, 5),
            fwd_us=value(),
            fwd_end_us=value(),
            bwd_end_us=value(),
            sync_end_us=value(),
            opt_start_us=value(),
            opt_end_us=value(),
        )
        judging = [(i, rnd.choice([rnd.uniform(0, 100), rnd.randint(0, 100)])) for i in rnd.sample(range(6), 3)]
        python, native = compact._Medians(6), compact._Medians(6)
        native.native = native_extension.judge_phases
        python._judging, native._judging = judging, judging
        assert native.judge(s) == python.judge(s)
        assert repr(native._recent) == repr(python._recent)  # (NaN == NaN is False: compared as written)
    with pytest.raises(TypeError):
        native_extension.judge_phases(base, None, [])
    with pytest.raises(IndexError):
        native_extension.judge_phases(base, [(6, 1.0)], [])


def accelerated_run(rank: int, world_size: int, tmp: str) -> tuple[bool, bool]:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    with ddpdoctor.instrument(ddp, run_dir=tmp) as monitor:
        for _ in range(40):
            ddp(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
        compactor = monitor.sink.compactor  # type: ignore[attr-defined]
        return compactor._columns is not None, compactor._medians.native is not None


def test_the_runtime_hands_its_extension_to_the_log_writer(tmp_path: Path, native_extension: Any) -> None:
    assert run_ranks(accelerated_run, 2, (str(tmp_path),), timeout=180) == [(True, True), (True, True)]
    log = load_run(tmp_path)
    assert [s.step for s in log.ranks[0].steps] == list(range(40)) and log.ranks[0].windows > 0
