"""The step record built in C++ (the native extension's ``build_step``) equals the one Python builds.

On the native route a host-clock step's record is built in C++ (``StepRecorder.build_step``); the
Python code is kept for CUDA marks and the Python route. Both must give the same record, field for
field, float for float, on every shape a step takes: missing marks, buckets not seen (None),
all-reduces not seen complete, broadcasts inside and outside the synchronizing forward, no
buckets at all.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest

from ddpdoctor.events import Step
from ddpdoctor.events.codec import encode
from ddpdoctor.runtime.step import native_hook
from ddpdoctor.runtime.step.clocks import HostClock
from ddpdoctor.runtime.step.recorder import PACKED_NONE, OpenStep, StepRecorder


@pytest.fixture(scope="module")
def build_step() -> Any:
    try:
        so = native_hook.build()
    except native_hook.NativeUnavailable as exc:
        pytest.skip(f"the native extension cannot be built here: {exc}")
    return native_hook._import(so.stem, so).build_step


def _steps(seed: int) -> list[OpenStep]:
    """Closed steps of every shape, with marks a few ms apart (t0 near a real perf_counter_ns)."""
    rnd = random.Random(seed)
    out = []
    base = 7_345_123_456_789
    for index in range(400):
        t0 = base + index * 3_000_001
        step = OpenStep(index, t0)
        step.t0_mono_ns, step.t0_wall_ns = t0, 1_700_000_000_000_000_000 + index
        step.micro = rnd.choice((0, 0, 0, 1, 3))

        def mark(lo: int, hi: int, t0: int = t0) -> int:
            return t0 + rnd.randint(lo, hi)

        def maybe(m: int) -> int | None:
            return None if rnd.random() < 0.15 else m

        step.fwd_start = rnd.choice((t0, t0, None, mark(1, 999)))
        step.fwd_end = maybe(mark(100_000, 400_000))
        step.bwd_end = maybe(mark(900_000, 1_500_000))
        step.opt_start = maybe(mark(1_600_000, 1_700_000))
        step.opt_end = maybe(mark(1_700_001, 2_000_000)) if step.opt_start is not None else None
        step.end = maybe(mark(2_000_001, 2_999_999))
        buckets = rnd.choice((0, 1, 4, 13))
        step.ready = [maybe(mark(400_000, 900_000)) for _ in range(buckets)]
        step.launch = [None if r is None else r + rnd.randint(0, 5_000) for r in step.ready]
        step.done = [None if r is None or rnd.random() < 0.1 else r + rnd.randint(1, 90_000) for r in step.ready]
        step.nbytes = [rnd.choice((4096, 262_144, None)) for _ in step.ready]
        for _ in range(rnd.choice((0, 0, 1, 2, 3))):
            a = mark(1_000, 90_000)
            step.bcast.append((a, a + rnd.randint(0, 7_777), rnd.random() < 0.6))
        step.bcast_bytes = 512 * len(step.bcast)
        step.synced_forward = True
        out.append(step)
    return out


def _built(recorder: StepRecorder, steps: list[OpenStep]) -> list[Step]:
    records: list[Any] = []
    recorder.emit = records.append
    for step in steps:
        recorder._emit_step(step)
    return [r for r in records if isinstance(r, Step)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_build_step_equals_the_python_record(build_step: Any, seed: int) -> None:
    python = StepRecorder(3, 1, lambda r: None, HostClock())
    native = StepRecorder(3, 1, lambda r: None, HostClock())
    native.build_step = build_step
    expected = _built(python, _steps(seed))
    got = _built(native, _steps(seed))
    assert len(got) == len(expected) == 400
    for a, b in zip(got, expected, strict=True):
        # the encoded lines too: a float that differs in its last bit, or an int passed as a
        # float, shows there
        assert encode(a) == encode(b), (a, b)
        assert a == b
    # the shapes the steps took (so the comparison covered them)
    assert any(s.bcast_us is not None for s in got) and any(s.sync_end_us is None and s.b_done_us for s in got)
    assert any(not s.b_ready_us for s in got) and any(None in s.b_ready_us for s in got)


def _packed(step: OpenStep) -> bool:
    """Pack ``step``'s bucket marks as the routine forward's drain does (``OpenStep.packed``,
    the lists left empty); False where a drain never packs them (a bucket without its ready or
    launch mark: the ring has both for every bucket it holds)."""
    if not step.ready or None in step.ready or None in step.launch:
        return False
    marks = []
    for ready, launch, done in zip(step.ready, step.launch, step.done, strict=True):
        marks += (ready, launch, PACKED_NONE if done is None else done)
    step.packed = struct.pack(f"={len(marks)}q", *marks)
    step.ready, step.launch, step.done = [], [], []
    return True


@pytest.mark.parametrize("seed", [3, 4])
def test_packed_marks_build_the_record_their_lists_build(build_step: Any, seed: int) -> None:
    """A step whose marks the routine forward packed gives the record its lists give: built in
    C++ from the packed marks, and in Python (``unpack_marks`` first) where no C++ builds it."""
    steps = [s for s in _steps(seed) if s.ready and None not in s.ready and None not in s.launch]
    expected = _built(StepRecorder(3, 1, lambda r: None, HostClock()), steps)
    lists = [(list(s.ready), list(s.launch), list(s.done)) for s in steps]
    packed = [s for s in _steps(seed) if _packed(s)]
    assert len(packed) == len(steps) >= 100 and all(s.packed is not None and not s.ready for s in packed)
    assert any(None in s for _, _, s in lists)  # all-reduces not seen complete, packed too
    native = StepRecorder(3, 1, lambda r: None, HostClock())
    native.build_step = build_step
    for a, b in zip(_built(native, packed), expected, strict=True):
        assert encode(a) == encode(b), (a, b)
    # without build_step, the lists are unpacked and Python builds the same record
    again = [s for s in _steps(seed) if _packed(s)]
    assert _built(StepRecorder(3, 1, lambda r: None, HostClock()), again) == expected
    assert [(s.ready, s.launch, s.done) for s in again] == lists and all(s.packed is None for s in again)
    broken = [s for s in _steps(seed) if _packed(s)][0]
    broken.packed = broken.packed[:-1]  # type: ignore[index]
    with pytest.raises(TypeError):
        build_step(broken, Step, 0, 0, "host")


def test_build_step_hands_the_bytes_over_and_rejects_what_is_not_a_step(build_step: Any) -> None:
    step = _steps(5)[1]
    record = build_step(step, Step, 0, 0, "host")
    assert record.b_bytes is step.nbytes  # handed over, as Python does: the step is closed
    with pytest.raises(AttributeError):
        build_step(object(), Step, 0, 0, "host")
    # an OpenStep's slots are read at their offsets; a slot left unset reads as the attribute does
    unset = _steps(5)[2]
    del unset.fwd_end
    with pytest.raises(AttributeError, match="fwd_end"):
        build_step(unset, Step, 0, 0, "host")
    # a class of another layout (here a subclass with a slot of its own) is read by name: the same record
    sub = type("Sub", (OpenStep,), {"__slots__": ("extra",)})
    for original in _steps(5):
        other = sub(original.index, original.t0)
        for name in OpenStep.__slots__:
            setattr(other, name, getattr(original, name))
        assert encode(build_step(other, Step, 0, 0, "host")) == encode(build_step(original, Step, 0, 0, "host"))
    step.ready = (1, 2)  # type: ignore[assignment]
    with pytest.raises(TypeError):
        build_step(step, Step, 0, 0, "host")


def test_a_column_reads_as_its_list_and_encodes_as_it(build_step: Any) -> None:
    """The bucket columns built in C++ are Columns (one object of doubles), read as the list they
    stand for, and are written as it: the codec's line equals the one of the record with lists."""
    import collections.abc
    import copy
    import pickle

    step = OpenStep(3, 1_000)
    step.t0_mono_ns, step.t0_wall_ns = 1_000, 5
    step.ready, step.launch, step.done = [2_000, None, 4_500], [2_100, None, 4_600], [3_000, None, 7_000]
    step.nbytes = [8, 8, 8]
    record = build_step(step, Step, 0, 0, "host")
    column = record.b_ready_us
    assert type(column) is not list and type(column).__name__ == "Column"
    assert isinstance(column, collections.abc.Sequence)
    as_list = [1.0, None, 3.5]
    assert column == as_list and as_list == column and (column != as_list) is False and column != [1.0, None]
    assert column != (1.0, None, 3.5)  # (as a list is not equal to a tuple)
    assert len(column) == 3 and bool(column) and list(column) == as_list and column.tolist() == as_list
    assert (column[0], column[1], column[-1], column[0:2], column[::-1]) == (
        1.0,
        None,
        3.5,
        [1.0, None],
        [3.5, None, 1.0],
    )
    assert None in column and 3.5 in column and 2.0 not in column and 3 not in column
    assert [0.5] + column == [0.5, 1.0, None, 3.5] and column + [9.0] == [1.0, None, 3.5, 9.0]
    assert repr(column) == repr(as_list) and sorted(t for t in column if t is not None) == [1.0, 3.5]
    assert copy.copy(column) is column and copy.deepcopy(column) is column  # read-only
    assert pickle.loads(pickle.dumps(column)) == as_list  # a pickle is its list
    for bad, error in ((3, IndexError), (-4, IndexError), ("a", TypeError)):
        with pytest.raises(error):
            column[bad]
    with pytest.raises(TypeError):
        hash(column)
    with pytest.raises(TypeError):
        type(column)()
    plain = record.with_lists()
    assert all(type(c) is list for c in (plain.b_ready_us, plain.b_launch_us, plain.b_done_us)) and plain == record
    assert plain.with_lists() is plain
    assert encode(record) == encode(plain) and b'"b_done_us":[2.0,null,6.0]' in encode(record)
    # a step without buckets: empty lists, left out of the line as the default is
    bare = build_step(OpenStep(4, 1_000), Step, 0, 0, "host")
    assert bare.b_ready_us == [] and type(bare.b_ready_us) is list and b"b_ready_us" not in encode(bare)


class _UsersSink:
    """A sink of the user's: encodes each record with msgspec's own encoder, as it may."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.columns: set[type] = set()

    def emit(self, record: Any) -> None:
        import msgspec

        if isinstance(record, Step):
            self.columns |= {type(record.b_ready_us), type(record.b_launch_us), type(record.b_done_us)}
        self.lines.append(msgspec.json.encode(record))

    def flush(self, timeout: float = 5.0) -> bool:
        return True

    def close(self, timeout: float = 5.0) -> None:
        pass


def _users_sink(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpdoctor
    from tests.models import make_model
    from tests.runtime_workers import BUCKET_CAP_MB, train

    torch.manual_seed(0)
    sink = _UsersSink()
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    monitor = ddpdoctor.instrument(ddp, sink=sink)  # type: ignore[arg-type]
    native = monitor.recorder.build_step is not None
    train(ddp, rank, steps=6)
    monitor.close()
    steps = [line for line in sink.lines if line.startswith(b'{"kind":"step"')]
    return {"native": native, "columns": sorted(t.__name__ for t in sink.columns), "steps": len(steps)}


def test_a_sink_of_the_users_gets_lists_it_can_encode(build_step: Any) -> None:
    """On the native route, a sink that is not ddpdoctor's gets every step record with list
    columns (``sinks.plain_columns``): msgspec's own encoder takes them."""
    from tests.ddp_harness import run_ranks

    for r in run_ranks(_users_sink, 2, timeout=240):
        assert r["native"] and r["steps"] == 6 and r["columns"] == ["list"], r


def _route_checks(rank: int, world_size: int) -> dict[str, Any]:
    """A real native-route run (no_sync micro-steps, BatchNorm broadcasts, Adam) whose records are
    also built in Python from the same closed steps, then a Python-route model."""
    import os

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpdoctor
    from ddpdoctor.sinks.memory import MemorySink
    from tests.models import make_model
    from tests.runtime_workers import BUCKET_CAP_MB, train

    torch.manual_seed(0)
    sink = MemorySink()
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    monitor = ddpdoctor.instrument(ddp, sink=sink)
    native = monitor.recorder.build_step
    shadow: list[Any] = []
    python = StepRecorder(rank, 0, shadow.append, HostClock())

    def both(step: OpenStep, *args: Any) -> Step:
        python._emit_step(step)  # the same closed step, built by Python
        return native(step, *args)  # type: ignore[misc]

    if native is not None:
        monitor.recorder.build_step = both
    train(ddp, rank, steps=7)
    monitor.close()
    got = [encode(r) for r in sink.records if isinstance(r, Step)]
    expected = [encode(r) for r in shadow if isinstance(r, Step)]
    os.environ["DDPDOCTOR_NATIVE"] = "0"
    other = ddpdoctor.instrument(DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB), sink=MemorySink())
    python_route = other.recorder.build_step is None
    other.close()
    return {"native": native is not None, "got": got, "expected": expected, "python_route": python_route}


def test_a_real_run_builds_its_records_in_cpp_and_they_equal_pythons(build_step: Any) -> None:
    from tests.ddp_harness import run_ranks

    for r in run_ranks(_route_checks, 2, timeout=240):
        assert r["native"], "the native route did not hand build_step to the recorder"
        assert len(r["got"]) == 7 and r["got"] == r["expected"]
        assert r["python_route"], "the Python route must build its records in Python"
