"""Pooled event marks (the CUDA clock's) are reused only once no open step holds them; a clean
close waits, bounded, for the last steps' events.

``CudaClock`` gives resolved events back to a pool. A step's end is the next step's start: the
same event. Recycled with the closed step, it was handed out again and recorded later while the
open step still used it as its start, and every offset of that step came out shifted (negative
forward times on a GPU). Checked on the recorder and the real ``CudaClock`` pool, with events
that stamp a counter instead of the device (this runs without a GPU).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ddpdoctor.events import Record, Step
from ddpdoctor.runtime.step.clocks import CudaClock
from ddpdoctor.runtime.step.recorder import StepRecorder

_TICKS = itertools.count(1)


class CountingEvent:
    """Stands in for ``torch.cuda.Event``: ``record`` stamps the next tick (1 tick = 1 ms)."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.at: int | None = None

    def record(self) -> None:
        self.at = next(_TICKS)

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, end: CountingEvent) -> float:
        assert self.at is not None and end.at is not None
        return float(end.at - self.at)


class Bucket:
    def __init__(self, nbytes: int) -> None:
        self._buffer = torch.zeros(nbytes // 4)

    def buffer(self) -> torch.Tensor:
        return self._buffer


def _clock() -> CudaClock:
    clock = CudaClock.__new__(CudaClock)
    clock._event = CountingEvent
    clock._pool = []
    clock._record = CountingEvent.record
    return clock


def _step(rec: StepRecorder, buckets: list[Any]) -> None:
    rec.forward_start(sync=True)
    rec.forward_end()
    step = rec.current
    assert step is not None
    for i, bucket in enumerate(buckets):
        rec.bucket_ready(i, bucket)
        rec.bucket_launched(step, i)
        rec.bucket_done(step, i)
    rec.backward_end(step)
    rec.sync_end(step)  # (the monitor calls it after DDP's finalization; a no-op on a fully marked step)
    rec.optimizer_start()
    rec.optimizer_end()


def _run(rec: StepRecorder, out: list[Record], buckets: list[Any], steps: int) -> list[Step]:
    """``steps`` steps, then a close: the step records emitted, checked to be all of them, in order."""
    for _ in range(steps):
        _step(rec, buckets)
    rec.close()
    records = [r for r in out if isinstance(r, Step)]
    assert [s.step for s in records] == list(range(steps))
    return records


def test_a_steps_start_is_not_reused_while_the_step_is_open() -> None:
    out: list[Record] = []
    clock = _clock()
    rec = StepRecorder(0, 0, out.append, clock)
    rec.bucket_marks_every_step = True
    for s in _run(rec, out, [Bucket(64), Bucket(64), Bucket(32)], 12):
        # marks in the order they were taken: every offset from the step's start is positive
        marks = [s.fwd_end_us, *s.b_ready_us, *s.b_done_us, s.bwd_end_us, s.opt_start_us, s.opt_end_us]
        assert all(m is not None and m > 0 for m in marks), s
        assert s.b_launch_us == s.b_ready_us  # one event for both: the launch is host work
        assert s.fwd_us == s.fwd_end_us  # one tick after the start
        if s.end_us is not None:
            assert s.end_us > s.opt_end_us  # type: ignore[operator]
    # each event sits in the pool once: a step holds one event under two names (ready, launch)
    assert len({id(e) for e in clock._pool}) == len(clock._pool)


def test_between_the_sampled_steps_only_the_first_and_last_bucket_and_the_sync_are_marked() -> None:
    """Timing events cost the GPU (about 44 µs each on an H200 transformer step): between the
    sampled steps a step marks its first and last bucket ready and DDP's wait's end, not two
    events per bucket, and still gives every phase, its arrivals and its exposed communication."""
    out: list[Record] = []
    clock = _clock()
    rec = StepRecorder(0, 0, out.append, clock)
    assert not rec.bucket_marks_every_step  # device marks: the default
    buckets = [Bucket(64), Bucket(64), Bucket(32), Bucket(16)]
    created = []
    real = clock._event

    def counted(enable_timing: bool = True) -> CountingEvent:
        created.append(1)
        return real(enable_timing=enable_timing)

    clock._event = counted
    for s in _run(rec, out, buckets, 10):
        assert s.b_bytes == [64, 64, 32, 16]
        assert s.fwd_us is not None and s.bwd_end_us is not None and s.opt_end_us is not None
        assert s.sync_end_us is not None
        span = s.ready_span_us()
        assert span is not None and span[0] < span[1] <= s.bwd_end_us
        if s.step in (0, 1, 3, 7):  # sampled: every bucket, ready and done
            assert None not in s.b_ready_us and len(s.b_done_us) == 4 and None not in s.b_done_us
        else:
            assert s.b_ready_us[1:3] == [None, None] and None not in (s.b_ready_us[0], s.b_ready_us[3])
            assert s.b_done_us == [] and s.b_launch_us == s.b_ready_us
            assert s.sync_end_us > s.bwd_end_us  # the mark after DDP's wait
    # events taken: the pool reuses them, so the count is what the busiest steps in flight held
    # (a fully marked step takes 4 ready + 4 done + 6 step marks; a partial one 2 + 1 + 6)
    assert len(created) < 10 * 9


class LateEvent(CountingEvent):
    """An event the device passes only after ``LateEvent.after`` more queries of anyone."""

    after = 0

    def query(self) -> bool:
        if LateEvent.after > 0:
            LateEvent.after -= 1
            return False
        return super().query()


def _late_run(wait_s: float) -> Step:
    out: list[Record] = []
    clock = _clock()
    clock._event = LateEvent
    rec = StepRecorder(0, 0, out.append, clock)
    _step(rec, [Bucket(64)])
    LateEvent.after = 50  # the GPU is still working on the last step when training ends
    rec.close(wait_s=wait_s)
    (step,) = [r for r in out if isinstance(r, Step)]
    return step


def test_a_clean_close_waits_for_the_last_steps_events_and_no_longer() -> None:
    waited = _late_run(wait_s=1.0)  # polled with query() until they are passed
    assert waited.fwd_us is not None and waited.b_ready_us and waited.b_done_us
    unwaited = _late_run(wait_s=0.0)  # a close from a signal: what the host knows
    assert unwaited.fwd_us is None and not unwaited.b_ready_us and unwaited.b_bytes == [64]


def test_the_hang_report_counts_unmarked_buckets_as_ready_and_done() -> None:
    """A step between the sampled ones marks few buckets: where a rank hangs, the report still
    counts every bucket that was ready and every one that completed, and names the first pending."""
    from ddpdoctor.runtime.process import watchdog

    rec = StepRecorder(0, 0, lambda r: None, _clock())
    buckets = [Bucket(64), Bucket(64), Bucket(32), Bucket(16)]
    for _ in range(2):
        _step(rec, buckets)  # steps 0 and 1 (sampled), then step 2 (not)
    rec.forward_start(sync=True)
    rec.forward_end()
    step = rec.current
    assert step is not None and not step.all_marks
    before = watchdog.signature(rec)
    for i, bucket in enumerate(buckets):
        rec.bucket_ready(i, bucket)
        rec.bucket_launched(step, i)
    rec.backward_end(step)
    for i in (0, 1):
        rec.bucket_done(step, i)
    assert watchdog.signature(rec) != before  # progress is seen
    where = watchdog.locate(rec)
    assert where["phase"] == "allreduce" and where["pending_bucket"] == 2
    assert (where["buckets_ready"], where["buckets_done"], where["buckets"]) == (4, 2, 4)
