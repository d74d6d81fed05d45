"""The hot path's shortcuts, in one process: the step record built a list at a time, live step
checks that skip a window with nothing to find, optimizer hooks over a tuple of weak refs."""

from __future__ import annotations

import gc
import time
import warnings
from typing import Any

import msgspec
import pytest
import torch

from ddpdoctor.categories import AccumulationWarning
from ddpdoctor.events import FindingRecord, Header, ParamInfo, Record, Step
from ddpdoctor.runtime.checks import live_findings
from ddpdoctor.runtime.checks.live_findings import LiveFindings
from ddpdoctor.runtime.step import native_hook
from ddpdoctor.runtime.step.clocks import HostClock, mono_ns
from ddpdoctor.runtime.step.optimizer_hooks import OptimizerHooks
from ddpdoctor.runtime.step.recorder import StepRecorder


class ScriptedClock(HostClock):
    """Host marks chosen by the test: each ``now()`` is the next value of ``marks``."""

    def __init__(self, marks: list[int]) -> None:
        self._marks = iter(marks)

    def now(self) -> int:  # type: ignore[override]
        return next(self._marks)


class Bucket:
    def __init__(self, n: int) -> None:
        self._buf = torch.zeros(n)

    def buffer(self) -> torch.Tensor:
        return self._buf


def test_host_clock_rel_us_is_us_of_each_mark() -> None:
    clock = HostClock()
    marks = [1_000, None, 3_456_789, 1_000]
    assert clock.rel_us(1_000, marks) == [clock.us(1_000, m) for m in marks] == [0.0, None, 3455.789, 0.0]
    assert HostClock.now() > 0 and isinstance(mono_ns(), int)  # the builtins themselves


def test_step_record_offsets_broadcast_and_missing_bucket() -> None:
    out: list[Record] = []
    # micro-step: forward start, broadcast; synchronizing forward: start, broadcast, end; bucket 1
    # ready, launched, done; bucket 0 ready, launched (never done); backward end; optimizer start,
    # end; the next forward, which closes the step
    clock = ScriptedClock(
        [1_000, 2_000, 2_500, 3_000, 10_000, 11_000, 12_500]
        + [20_000, 30_000, 31_000, 40_000, 32_000, 33_000, 35_000, 50_000, 60_000]
    )
    rec = StepRecorder(0, 0, out.append, clock)
    rec.forward_start(sync=False)
    rec.buffers_broadcast(clock.now(), clock.now(), 64)
    rec.forward_end()
    rec.forward_start(sync=True)
    rec.buffers_broadcast(clock.now(), clock.now(), 64)
    rec.forward_end()
    step = rec.bucket_ready(1, Bucket(4))
    assert step is not None
    rec.bucket_launched(step, 1)
    rec.bucket_done(step, 1)
    rec.bucket_ready(0, Bucket(2))
    rec.bucket_launched(step, 0)
    rec.backward_end(step)
    rec.optimizer_start()
    rec.optimizer_end()
    rec.forward_start(sync=True)  # closes the step: emitted now (host marks need no wait)
    (record,) = out
    assert isinstance(record, Step)
    assert record.micro == 1 and record.bcast_bytes == 128
    assert record.fwd_start_us == 2.0 and record.fwd_end_us == 11.5
    assert record.bcast_start_us == 1.0 and record.bcast_us == 0.5 + 1.0
    assert record.fwd_us == 9.5 - 1.0  # the broadcast in the synchronizing forward is left out
    assert record.b_ready_us == [39.0, 19.0] and record.b_launch_us == [31.0, 29.0]
    assert record.b_done_us == [None, 30.0] and record.sync_end_us is None  # bucket 0 never completed
    assert record.b_bytes == [8, 16]
    assert (record.bwd_end_us, record.opt_start_us, record.opt_end_us, record.end_us) == (32.0, 34.0, 49.0, 59.0)
    assert rec.steps_emitted == 1 and rec.current is not None and rec.current.index == 1


HEADER = Header(rank=0, params=[ParamInfo(name="w", shape=[4], dtype="float32", numel=4, requires_grad=True)])


def _step(i: int, opt: bool, bcast: float | None = None) -> Step:
    return Step(
        rank=0,
        step=i,
        t0_mono_ns=0,
        t0_wall_ns=0,
        b_ready_us=[100.0],
        b_done_us=[200.0],
        b_bytes=[1 << 20],
        sync_end_us=200.0,
        bcast_us=bcast,
        opt_start_us=300.0 if opt else None,
        end_us=1000.0,
    )


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"bcast": 0, "accum": 0}
    bcast, accum = live_findings.buffer_broadcast_cost, live_findings.sync_during_accumulation

    def counted_bcast(*args: Any, **kwargs: Any) -> Any:
        calls["bcast"] += 1
        return bcast(*args, **kwargs)

    def counted_accum(*args: Any) -> Any:
        calls["accum"] += 1
        return accum(*args)

    monkeypatch.setattr(live_findings, "buffer_broadcast_cost", counted_bcast)
    monkeypatch.setattr(live_findings, "sync_during_accumulation", counted_accum)
    return calls


def test_live_step_checks_skip_a_window_with_nothing_to_find(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch)
    out: list[Record] = []
    live = LiveFindings(0, 0, out.append, lambda: None)
    live.observe(HEADER)
    for i in range(live_findings.WARMUP + 2 * live_findings.EVERY):
        live.observe(_step(i, opt=True))
    assert calls == {"bcast": 0, "accum": 0} and live._checked
    # one broadcasting step: the next check looks, and keeps looking while it is in the window
    live.observe(_step(1000, opt=True, bcast=5.0))
    for i in range(live_findings.EVERY):
        live.observe(_step(1001 + i, opt=True))
    assert calls == {"bcast": 1, "accum": 0}
    for i in range(live_findings.WINDOW + live_findings.EVERY):
        live.observe(_step(2000 + i, opt=True))
    assert calls["bcast"] == 2  # once more, then it left the window
    assert not out


def test_live_accumulation_finding_still_raised_on_the_observing_thread() -> None:
    out: list[Record] = []
    live = LiveFindings(0, 0, out.append, lambda: None)
    live.observe(HEADER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(live_findings.WARMUP):
            live.observe(_step(i, opt=i % 2 == 1))  # two synchronized backwards per optimizer step
    assert [w.category for w in caught] == [AccumulationWarning]
    # attributed to the line that fed the step (the script's forward), not to ddpdoctor's code
    assert caught[0].filename == __file__, caught[0].filename
    assert [getattr(r, "code", None) for r in out] == ["sync-during-accumulation"]


def test_live_checks_of_a_batch_are_those_of_its_steps_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorder hands closed steps over in batches (``observe_steps``): the step-based
    checks must run at the same steps over the same windows, and raise the same findings, as
    when each step is observed alone."""
    steps = [_step(i, opt=i % 3 != 1, bcast=5.0 if i == 40 else None) for i in range(300)]

    def run(batches: list[list[Step]]) -> tuple[list[Any], list[tuple[int, int]]]:
        out: list[Record] = []
        live = LiveFindings(0, 0, out.append, lambda: None)
        seen: list[tuple[int, int]] = []  # (last step in the window, window size) at each check
        check = live._check_steps

        def recorded() -> None:
            seen.append((live.steps[-1].step, len(live.steps)))
            check()

        monkeypatch.setattr(live, "_check_steps", recorded)
        live.observe(HEADER)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for batch in batches:
                live.observe_steps(batch)
        return [(r.code, r.step) for r in out if isinstance(r, FindingRecord)], seen

    one_by_one = run([[s] for s in steps])
    sizes = [1, 32, 7, 50, 3, 16, 32, 91, 68]
    batches, at = [], 0
    for size in sizes:
        batches.append(steps[at : at + size])
        at += size
    assert at == len(steps)
    assert run(batches) == one_by_one
    assert one_by_one[0] and len(one_by_one[1]) >= 4  # findings raised, several checks run


class Observer:
    def __init__(self) -> None:
        self.calls: list[bool] = []

    def on_optimizer(self, start: bool) -> None:
        self.calls.append(start)

    def optimizer_stamps(self) -> Any:
        return None  # the Python hooks


class StampedObserver(Observer):
    """An observer with the extension's C++ stamps: its optimizer steps run no Python."""

    def __init__(self, stamps: Any) -> None:
        super().__init__()
        self.stamps = stamps

    def optimizer_stamps(self) -> Any:
        return self.stamps


def test_optimizer_hooks_call_live_observers_and_skip_freed_ones() -> None:
    hooks = OptimizerHooks()
    kept, freed = Observer(), Observer()
    try:
        hooks.watch(kept)
        hooks.watch(freed)
        del freed
        gc.collect()
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        opt.step()
        assert kept.calls == [True, False]
        hooks.unwatch(kept)
        opt.step()
        assert kept.calls == [True, False] and not hooks._handles
    finally:
        hooks.shutdown()


def test_optimizer_hooks_in_cpp_stamp_without_python_and_go_when_unwatched() -> None:
    try:
        extension = native_hook.load()
    except native_hook.NativeUnavailable as exc:
        pytest.skip(f"the native extension cannot be built here: {exc}")
    hooks = OptimizerHooks()
    stamped, python = StampedObserver(extension.OptimizerStamps()), Observer()
    try:
        hooks.watch(stamped)
        hooks.watch(python)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        assert stamped.stamps.take(0) is None  # nothing yet
        before = time.perf_counter_ns()
        opt.step()
        after = time.perf_counter_ns()
        assert stamped.calls == [] and python.calls == [True, False]  # C++ only for the first
        events = stamped.stamps.take(0)
        assert [start for start, _ in events] == [True, False]
        assert before <= events[0][1] <= events[1][1] <= after  # the clock of perf_counter_ns
        assert stamped.stamps.take(5) is None and not stamped.stamps.running()  # taken once
        for _ in range(40):  # the log keeps the first 16 events until taken
            opt.step()
        assert len(stamped.stamps.take(0)) == 16
        hooks.unwatch(stamped)
        opt.step()
        assert stamped.stamps.take(0) is None  # its hooks went with it; the Python ones stay
        assert python.calls[-2:] == [True, False]
    finally:
        hooks.shutdown()
    opt.step()
    assert stamped.stamps.take(0) is None and len(python.calls) == 2 + 40 * 2 + 2
    stamped.stamps.pre(opt, (), {})  # a step that started and has not ended: the watchdog's phase
    assert stamped.stamps.running()


def test_native_marks_in_order_or_not_give_the_same_step() -> None:
    """A peek then a drain (every bucket once, in index order: lists built whole) give the marks
    the bucket-by-bucket path gives (out of order, a bucket missing, a done not seen)."""
    peek = [(0, 10, 11, 20, 400), (1, 12, 13, 0, 800)]
    drain = [(0, 10, 11, 20, 400), (1, 12, 13, 25, 800), (2, 14, 15, 0, 96)]

    def marks(*batches: list[tuple[int, int, int, int, int]]) -> tuple[list[Any], ...]:
        recorder = StepRecorder(0, 0, lambda record: None)
        step = recorder.forward_start(sync=True)
        for batch in batches:  # as the native ring's drain hands them over: columns
            indices = [m[0] for m in batch]
            recorder.add_bucket_columns(
                step,
                indices,
                [m[1] for m in batch],
                [m[2] for m in batch],
                [m[3] or None for m in batch],
                [m[4] for m in batch],
                indices == list(range(len(batch))),
            )
        return step.ready, step.launch, step.done, step.nbytes

    expected = ([10, 12, 14], [11, 13, 15], [20, 25, None], [400, 800, 96])
    assert marks(peek, drain) == expected
    assert marks(drain) == expected
    assert marks(list(reversed(drain))) == expected  # out of order: bucket by bucket
    assert marks(drain, peek[:1]) == expected  # a late leftover overwrites only its own bucket
    assert marks([drain[0], drain[2]]) == ([10, None, 14], [11, None, 15], [20, None, None], [400, None, 96])
    assert marks([]) == ([], [], [], [])


def _bcast_steps(first: int, n: int, bcast_us: float) -> list[Step]:
    return [msgspec.structs.replace(_step(first + i, opt=True, bcast=bcast_us), bcast_bytes=2048) for i in range(n)]


def _bcast_warnings(feed: list[Step], finish: bool) -> tuple[list[str], list[Record]]:
    out: list[Record] = []
    live = LiveFindings(0, 0, out.append, lambda: None)
    live.observe(HEADER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in feed:
            live.observe(s)
        if finish:
            live.finish()
    return [str(w.message) for w in caught], out


def test_a_broadcast_slow_only_at_start_up_is_not_warned_live() -> None:
    """The first check's window is the start-up: its slow broadcasts (a loaded host, the first
    collectives) would say 20% of the step where the run says 3%; the warning waits for the next
    check, which finds the run's own figure (info, logged, not said)."""
    slow = _bcast_steps(0, live_findings.WARMUP, 200.0)  # 20% of the 1 ms step
    said, out = _bcast_warnings([*slow, *_bcast_steps(100, live_findings.EVERY, 40.0)], finish=True)
    assert said == []
    assert [(r.code, r.severity) for r in out if hasattr(r, "severity")] == [("buffer-broadcast-cost", "info")]


def test_a_broadcast_that_stays_slow_is_warned_at_the_second_check_or_at_close() -> None:
    steady = _bcast_steps(0, live_findings.WARMUP + live_findings.EVERY, 200.0)
    said, out = _bcast_warnings(steady, finish=False)
    assert len(said) == 1 and "buffer-broadcast-cost" in said[0]
    assert [getattr(r, "step", None) for r in out] == [0]
    # a job shorter than two checks: held at the first, said at the clean close, over every step
    said, out = _bcast_warnings(_bcast_steps(0, live_findings.WARMUP + 6, 200.0), finish=False)
    assert said == [] and out == []
    said, _ = _bcast_warnings(_bcast_steps(0, live_findings.WARMUP + 6, 200.0), finish=True)
    assert len(said) == 1 and "26 steps" in said[0]


def test_a_broadcast_warned_once_is_not_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing more of buffer-broadcast-cost can be raised after its warning: the check, the
    live checks' heaviest, stops; a check before the warning still runs at every turn."""
    calls = _counting(monkeypatch)
    checks = 2 + 3  # the first (held), the second (warned), then three more turns
    said, out = _bcast_warnings(
        _bcast_steps(0, live_findings.WARMUP + (checks - 1) * live_findings.EVERY, 200.0), False
    )
    assert len(said) == 1 and calls["bcast"] == 2
    assert [(r.code, r.severity) for r in out if hasattr(r, "severity")] == [("buffer-broadcast-cost", "warning")]
    calls["bcast"] = 0  # a broadcast at 4% of the step: info, never a warning; checked every turn
    said, out = _bcast_warnings(_bcast_steps(0, live_findings.WARMUP + (checks - 1) * live_findings.EVERY, 40.0), False)
    assert said == [] and calls["bcast"] == checks


def test_next_sampled_is_the_first_sampled_step_from_there() -> None:
    """The routine forward asks the sampled checks only from ``next_sampled`` on: it must name
    the schedule's next sampled step exactly (a step later would skip a sample)."""
    import itertools

    from ddpdoctor.events.schedule import is_sampled, next_sampled

    for every in (1, 2, 3, 4, 5, 8, 50, 64):
        for step in range(400):
            expected = next(s for s in itertools.count(step) if is_sampled(s, every))
            assert next_sampled(step, every) == expected, (step, every)


def test_a_step_is_anchored_where_it_starts_not_after_the_batch_its_forward_emits() -> None:
    """A forward that closes the step before may emit a batch of records (at the first step, and
    every 16th) before it opens its own. The new step's monotonic and wall anchors are read with
    its start, so the records chain: each step starts where the one before ended, however long
    the emission took (here 3 ms a record: a loaded host's sink and live checks)."""
    out: list[Record] = []

    def slow_emit(record: Record) -> None:
        began = time.perf_counter_ns()
        while time.perf_counter_ns() - began < 3_000_000:
            pass
        out.append(record)

    rec = StepRecorder(0, 0, slow_emit, HostClock())
    for _ in range(20):  # (bare steps: a synchronizing forward each, nothing else)
        rec.forward_start(sync=True)
        rec.forward_end()
    rec.close()
    steps = [r for r in out if isinstance(r, Step)]
    assert [s.step for s in steps] == list(range(20))
    for a, b in zip(steps, steps[1:], strict=False):
        assert a.end_us is not None
        assert abs((b.t0_mono_ns - a.t0_mono_ns) / 1000.0 - a.end_us) < 500.0, (a.step, b.t0_mono_ns - a.t0_mono_ns)
        assert abs((b.t0_wall_ns - a.t0_wall_ns) / 1000.0 - a.end_us) < 500.0, a.step


def test_buffer_slots_read_the_buffers_of_named_buffers_and_see_one_assigned_anew() -> None:
    from ddpdoctor.runtime.checks.sampled import buffer_slots

    shared = torch.zeros(3)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model[1].register_buffer("constant", shared)
    model[1].register_buffer("missing", None)
    model.register_buffer("again", shared)  # the same tensor twice: listed once, as named_buffers does
    slots = buffer_slots(model)
    assert [id(d[n]) for d, n in slots] == [id(b) for _, b in model.named_buffers()]
    assert len(slots) == 7
    fresh = torch.ones(4)
    model[2].running_mean = fresh  # assigned anew: the slot reads the new tensor
    assert any(d[n] is fresh for d, n in slots)


def test_the_compiled_autograd_flag_reads_as_torch_config_does_through_every_kind_of_setting() -> None:
    """``compiled_autograd_asked`` reads torch's config in full only when the user's setting
    moved: after each way a script sets it (assignment, ``patch``, back to the default), its
    answer is the config module's own."""
    import torch._dynamo.config as config

    from ddpdoctor.runtime.torch_compat import DYNAMO_CONFIG_MODULE, _ConfigFlag

    flag = _ConfigFlag(DYNAMO_CONFIG_MODULE, "compiled_autograd")
    original = config.compiled_autograd
    answers = []
    try:
        for _ in range(2):
            answers.append((flag(), bool(config.compiled_autograd)))
        config.compiled_autograd = True
        answers.append((flag(), True))
        answers.append((flag(), True))
        config.compiled_autograd = False
        answers.append((flag(), False))
        with config.patch(compiled_autograd=True):
            answers.append((flag(), True))
        answers.append((flag(), False))
        config.compiled_autograd = True
        answers.append((flag(), True))
    finally:
        config.compiled_autograd = original
    answers.append((flag(), bool(original)))
    assert [a for a, _ in answers] == [want for _, want in answers]
    # a flag of a module that is not loaded reads False; one that the module lacks, False
    assert _ConfigFlag("ddpdoctor_no_such_module", "x")() is False
    assert _ConfigFlag(DYNAMO_CONFIG_MODULE, "ddpdoctor_no_such_flag")() is False
