"""Closed steps are emitted together on short steps, in order, and before any other record.

The recorder holds a closed step until the last emission is ``BATCH_NS`` old (or ``BATCH_STEPS``
wait); the monitor emits what waits before any other record, and a process sample takes only
steps that waited ``_STALE_NS``. Checked on the recorder alone with chosen marks, and on real
gloo ranks through a real monitor.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor.events import End, Fingerprint, GradFlags, ProcSample, Record, Step, Unused
from ddpdoctor.runtime.step import hooks as hooks_module
from ddpdoctor.runtime.step.clocks import HostClock
from ddpdoctor.runtime.step.recorder import BATCH_NS, BATCH_STEPS, StepRecorder
from ddpdoctor.sinks.memory import MemorySink
from tests.ddp_harness import run_ranks
from tests.models import make_model

MS = 1_000_000


class SetClock(HostClock):
    """Host marks the test sets: ``now()`` is ``at``."""

    def __init__(self) -> None:
        self.at = 0

    def now(self) -> int:  # type: ignore[override]
        return self.at


def _step_at(rec: StepRecorder, clock: SetClock, at: int) -> None:
    """A synchronizing forward at ``at`` (it closes the step before) and its forward end."""
    clock.at = at
    rec.forward_start(sync=True)
    rec.forward_end()


def test_short_steps_wait_and_go_out_together_in_order() -> None:
    out: list[Record] = []
    clock = SetClock()
    rec = StepRecorder(0, 0, out.append, clock)
    _step_at(rec, clock, 1_000 * MS)
    _step_at(rec, clock, 1_001 * MS)  # closes step 0: the first step goes out at once
    assert [r.step for r in out if isinstance(r, Step)] == [0]
    for i in range(2, 10):  # 1 ms steps: closed, waiting
        _step_at(rec, clock, (1_000 + i) * MS)
    assert [r.step for r in out if isinstance(r, Step)] == [0]
    assert rec.steps_emitted == 1 and rec.steps_closed == 9 and rec.closed_waiting
    _step_at(rec, clock, 1_001 * MS + BATCH_NS)  # the last emission is BATCH_NS old: all of them
    assert [r.step for r in out if isinstance(r, Step)] == list(range(10))
    assert rec.steps_closed == rec.steps_emitted == 10 and not rec.closed_waiting
    # at most BATCH_STEPS wait, however short the steps
    base = 1_001 * MS + BATCH_NS  # the last emission
    for i in range(1, BATCH_STEPS):
        _step_at(rec, clock, base + i * 1_000)
    assert rec.steps_emitted == 10 and rec.steps_closed == 10 + BATCH_STEPS - 1
    _step_at(rec, clock, base + BATCH_STEPS * 1_000)
    assert rec.steps_emitted == 10 + BATCH_STEPS
    rec.close()  # the rest, and the open step
    steps = [r.step for r in out if isinstance(r, Step)]
    assert steps == list(range(len(steps))) and rec.steps_emitted == len(steps) == 10 + BATCH_STEPS + 1


def test_long_steps_go_out_as_they_close() -> None:
    out: list[Record] = []
    clock = SetClock()
    rec = StepRecorder(0, 0, out.append, clock)
    for i in range(6):
        _step_at(rec, clock, i * BATCH_NS)
        assert rec.steps_emitted == i and not rec.closed_waiting  # the step before, at once


def test_another_thread_emits_what_waits_once_and_in_order() -> None:
    out: list[Record] = []
    clock = SetClock()
    rec = StepRecorder(0, 0, out.append, clock)
    stop = threading.Event()

    def other() -> None:  # a watchdog or a sampler taking the waiting steps meanwhile
        while not stop.is_set():
            rec.emit_closed()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        for i in range(3000):
            _step_at(rec, clock, 10 * MS + i * 1_000)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    rec.close()
    steps = [r.step for r in out if isinstance(r, Step)]
    assert steps == list(range(3000))


def _batching_worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    sink = MemorySink()
    ddp = DDP(make_model())
    monitor = ddpdoctor.instrument(ddp, sink=sink, check_every=1000, proc_interval=3600.0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(8, 32), torch.randn(8, 4)
    out: dict[str, Any] = {}
    for _ in range(12):
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    out["steps_prop"] = monitor.steps
    out["emitted"] = len(sink.of_kind(Step))
    out["waiting"] = monitor.recorder.closed_waiting
    sample = ProcSample(rank=rank, t_mono_ns=0, t_wall_ns=0, cpu_pct=0.0, rss_bytes=0)
    monitor.emit(sample)  # fresh steps stay with the training thread
    out["emitted_after_fresh_sample"] = len(sink.of_kind(Step))
    # a sampled check's records, which the log reads in any order, do not send them out either
    monitor.emit(Unused(rank=rank, step=11, names=[]))
    monitor.emit(sink.of_kind(Fingerprint)[-1])  # (the last sample's again: nothing new to find)
    out["emitted_after_checks"] = len(sink.of_kind(Step))
    hooks_module._STALE_NS = 0
    monitor.emit(sample)  # they have waited long enough: they go out first
    out["emitted_after_stale_sample"] = len(sink.of_kind(Step))
    # a parameter frozen after wrapping: the next forward's check emits a grad_flags record
    for _ in range(5):
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    next(ddp.module.parameters()).requires_grad_(False)
    ddp(x)
    monitor.close()
    records = list(sink.records)
    flags = next(i for i, r in enumerate(records) if isinstance(r, GradFlags))
    flag_record = records[flags]
    assert isinstance(flag_record, GradFlags)
    out["flag_step"] = flag_record.step
    out["steps_before_flags"] = [r.step for r in records[:flags] if isinstance(r, Step)]
    out["steps_after_flags"] = [r.step for r in records[flags:] if isinstance(r, Step)]
    out["all_steps"] = [r.step for r in sink.records if isinstance(r, Step)]
    out["end_steps"] = next(r.steps for r in sink.records if isinstance(r, End))
    return out


def test_real_ranks_keep_every_step_in_order_before_other_records() -> None:
    for r in run_ranks(_batching_worker, world_size=2, timeout=240):
        # 12 steps, the last still open: 11 closed; monitor.steps counts those that wait
        assert r["steps_prop"] == 11 and 1 <= r["emitted"] <= 11 and r["waiting"] == (r["emitted"] < 11)
        if r["waiting"]:
            assert r["emitted_after_fresh_sample"] == r["emitted_after_checks"] == r["emitted"] < 11
        assert r["emitted_after_stale_sample"] == 11
        # every step closed before the grad_flags record is written before it
        assert r["steps_before_flags"] == list(range(r["flag_step"])) and r["steps_after_flags"] == [r["flag_step"]]
        assert r["all_steps"] == list(range(r["flag_step"] + 1)) == list(range(r["end_steps"]))
