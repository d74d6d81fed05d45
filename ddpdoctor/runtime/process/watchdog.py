"""The hang watchdog: one daemon thread per process notices when a monitored step stops moving.

Progress is not counted on the hot path: once a second the thread reads a small signature of
the step in progress (step index, buckets ready and done, forward/backward/optimizer marks). If
it has not changed for ``hang_timeout`` seconds, the rank is stalled: the watchdog records where
it is (phase, step, pending bucket, the training thread's Python stack) as a ``hang`` record,
flushed at once, and warns when the rank is blocked inside a collective, which means it waits
for another rank. When progress comes back, a ``resumed`` record closes the stall (a slow
checkpoint, not a hang).
"""

from __future__ import annotations

import sys
import threading
import traceback
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ddpdoctor.analysis.hang import COLLECTIVE_PHASES, where_waiting
from ddpdoctor.categories import HangWarning, warn
from ddpdoctor.events import FindingRecord, Hang, environment
from ddpdoctor.events.layout import HANG_TIMEOUT_ENV
from ddpdoctor.runtime.step.clocks import mono_ns, wall_ns

if TYPE_CHECKING:
    from ddpdoctor.runtime.protocols import Watched
    from ddpdoctor.runtime.step.recorder import StepRecorder

#: Default seconds without progress before a rank counts as stalled: far below the process
#: group's own timeout (10 to 30 minutes), above any ordinary step.
DEFAULT_HANG_TIMEOUT = 120.0
#: Stack frames kept in a hang record (innermost last).
MAX_FRAMES = 40


def hang_timeout_from_env(explicit: float | None) -> float:
    """``explicit`` if given, else ``$DDPDOCTOR_HANG_TIMEOUT``, else the default; 0 turns it off."""
    if explicit is not None:
        return max(0.0, float(explicit))
    raw = environment.read(HANG_TIMEOUT_ENV)
    if raw:
        try:
            return max(0.0, float(raw))
        except ValueError:
            warn(f"ddpdoctor: ignoring {HANG_TIMEOUT_ENV}={raw!r} (not a number of seconds)", HangWarning, stacklevel=3)
    return DEFAULT_HANG_TIMEOUT


def signature(recorder: StepRecorder) -> tuple[Any, ...]:
    """What changes whenever the rank makes progress (read from another thread: races are benign)."""
    step = recorder.current
    if step is None:
        return (recorder.next_index, None)
    done = sum(1 for m in list(step.done) if m is not None) + sum(list(step.done_seen))
    return (
        step.index,
        step.micro,
        len(step.ready),
        done,
        step.fwd_end is not None,
        step.bwd_end is not None,
        step.opt_start is not None,
        step.opt_end is not None,
        recorder.in_forward,
        recorder.in_broadcast,
        len(step.bcast),
    )


def locate(
    recorder: StepRecorder,
    in_flight: Sequence[tuple[int, int, int, int, int]] = (),
    backward_ended: bool = False,
    optimizer_running: bool = False,
) -> dict[str, Any]:
    """Where the rank is: phase, step, buckets ready/done and the first pending bucket.

    ``in_flight``: on the native route, the bucket stamps still in the ring (not yet drained
    into the step: the drain runs once the all-reduces completed), as (index, ready, launch,
    done, bytes) with done 0 when not seen. ``backward_ended``: on the native route, the
    backward's compute end is stamped in the ring, not yet in the step. ``optimizer_running``:
    an optimizer step stamped in C++ started and has not ended (its stamps not yet in the step).
    """
    step = recorder.current
    if step is None:
        return {"step": recorder.next_index, "phase": "between steps"}
    ready_marks: list[Any] = list(step.ready)
    done_marks: list[Any] = list(step.done)
    if not step.all_marks:  # buckets left unmarked between the sampled steps: seen, not timed
        ready_marks = [True if b is not None else None for b in list(step.nbytes)]
        seen = list(step.done_seen)
        done_marks = [True if i < len(seen) and seen[i] else None for i in range(len(ready_marks))]
    if not ready_marks and in_flight:
        count = max(i for i, *_ in in_flight) + 1
        ready_marks, done_marks = [None] * count, [None] * count
        for index, ready_ns, _, done_ns, _ in in_flight:
            ready_marks[index], done_marks[index] = ready_ns, done_ns or None
    ready = [m is not None for m in ready_marks]
    done = done_marks + [None] * max(0, len(ready) - len(done_marks))
    pending = next((i for i, m in enumerate(done) if m is None), None)
    if recorder.in_broadcast:
        phase = "buffer broadcast"
    elif recorder.in_forward:
        phase = "forward"
    elif not ready_marks:
        phase = "backward" if step.synced_forward else "between steps"
    elif step.bwd_end is None and not backward_ended:
        phase = "backward"
    elif pending is not None:
        phase = "allreduce"
    elif (step.opt_start is not None and step.opt_end is None) or optimizer_running:
        phase = "optimizer"
    else:
        phase = "between steps"
    return {
        "step": step.index,
        "phase": phase,
        "pending_bucket": pending if phase == "allreduce" else None,
        "buckets_ready": sum(ready),
        "buckets_done": sum(1 for m in done if m is not None),
        "buckets": max(len(ready), len(recorder.layout_bytes())),
    }


#: DDP's methods that broadcast the module buffers (``nn/parallel/distributed.py``).
_DDP_BROADCAST = (" in _sync_buffers:", " in _sync_module_buffers:", " in _distributed_broadcast_coalesced:")


def collective_in_stack(stack: Sequence[str]) -> str:
    """The collective a stack is blocked in, where the step marks cannot tell (a forward outside a
    training step, a collective of the script's own): "broadcast_coalesced" for DDP's buffer
    broadcast, else the outermost public ``torch.distributed`` function on the stack (the call the
    script made: ``barrier``, ``all_reduce``, ``all_gather_object``), else "" (not in a collective)."""
    for line in stack:
        path = line.split(":", 1)[0].replace("\\", "/")
        if path.endswith("torch/nn/parallel/distributed.py") and any(m in line for m in _DDP_BROADCAST):
            return "broadcast_coalesced"
        if path.endswith("torch/distributed/distributed_c10d.py"):
            name = line.split(" in ", 1)[1].split(":", 1)[0] if " in " in line else ""
            if name and not name.startswith("_"):
                return name
    return ""


def thread_stack(thread_id: int | None) -> list[str]:
    """The Python stack of a thread, one line per frame (``file:line in function: source``)."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return []
    out = []
    for fs in traceback.extract_stack(frame)[-MAX_FRAMES:]:
        line = f"{fs.filename}:{fs.lineno} in {fs.name}"
        out.append(f"{line}: {fs.line.strip()}" if fs.line else line)
    return out


class _Watch:
    """Per-monitor state: last signature, when it last changed, whether a stall is open."""

    __slots__ = ("monitor_ref", "timeout", "last", "since", "stalled_at", "thread_id")

    def __init__(self, monitor: Watched, timeout: float, thread_id: int) -> None:
        #: weak: a monitor the script drops without close (and its model) is not kept by this thread
        self.monitor_ref = weakref.ref(monitor)
        self.timeout = timeout
        self.last: tuple[Any, ...] | None = None
        self.since = mono_ns()
        self.stalled_at: int | None = None
        self.thread_id = thread_id

    @property
    def monitor(self) -> Watched:
        monitor = self.monitor_ref()
        if monitor is None:
            raise ReferenceError("the watched monitor is gone")
        return monitor


class Watchdog:
    """The process-wide watchdog thread (one, however many models are monitored)."""

    def __init__(self) -> None:
        self._watches: dict[int, _Watch] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ddpdoctor-watchdog", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread (``Services.shutdown``)."""
        self._stop = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def add(self, monitor: Watched, timeout: float) -> None:
        with self._lock:
            self._watches[id(monitor)] = _Watch(monitor, timeout, threading.get_ident())
        self._wake.set()

    def remove(self, monitor: Watched) -> None:
        with self._lock:
            self._watches.pop(id(monitor), None)

    def _interval(self) -> float:
        with self._lock:
            timeouts = [w.timeout for w in self._watches.values()]
        return max(0.05, min([1.0] + [t / 8.0 for t in timeouts]))

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self._interval())
            self._wake.clear()
            if self._stop:
                return
            self._round()

    def _round(self) -> None:
        # its own frame: no monitor stays referenced from this thread while it sleeps (a closed
        # monitor, and through it a DDP model, must be freed when the script lets it go)
        with self._lock:
            watches = list(self._watches.items())
        for key, watch in watches:
            monitor = watch.monitor_ref()
            if monitor is None:  # dropped without close
                with self._lock:
                    if self._watches.get(key) is watch:  # the id may be a newer monitor's by now
                        del self._watches[key]
                continue
            if monitor.closed or not monitor.probes.on["watchdog"]:
                continue
            try:
                self._check(watch)
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                monitor.probes.failed("watchdog", exc)

    def _check(self, watch: _Watch) -> None:
        monitor = watch.monitor
        now = mono_ns()
        current = signature(monitor.recorder)
        if current != watch.last:
            if watch.stalled_at is not None:
                self._emit(watch, "resumed", (now - watch.since) / 1e9)
                watch.stalled_at = None
            watch.last, watch.since = current, now
            return
        waited = (now - watch.since) / 1e9
        if (
            watch.stalled_at is None
            and waited >= watch.timeout
            and monitor.recorder.steps_emitted + (monitor.recorder.current is not None) > 0
        ):
            watch.stalled_at = now
            self._emit(watch, "stalled", waited)

    def _emit(self, watch: _Watch, state: str, waited: float) -> None:
        monitor = watch.monitor
        where = locate(
            monitor.recorder,
            monitor.buckets_in_flight(),
            monitor.backward_ended_in_flight(),
            monitor.optimizer_running(),
        )
        stack = thread_stack(watch.thread_id) if state == "stalled" else []
        collective = ""
        if where["phase"] in ("between steps", "forward"):
            # the marks see no collective, the stack may: a forward through the wrapper outside a
            # training step (grad off) broadcasting the buffers, the script's own barrier
            collective = collective_in_stack(stack)
            if collective:
                where["phase"] = "buffer broadcast" if collective == "broadcast_coalesced" else "collective"
        record = Hang(
            rank=monitor.rank,
            ddp=monitor.ddp_index,
            t_mono_ns=mono_ns(),
            t_wall_ns=wall_ns(),
            state=state,
            waited_s=round(waited, 3),
            stack=stack,
            collective=collective,
            **where,
        )
        monitor.emit(record)
        if state == "stalled" and record.phase in COLLECTIVE_PHASES:
            title = (
                f"rank {monitor.rank} has waited {waited:.0f} s in {where_waiting(record)}: "
                "another rank is not there, or the collective does not complete"
            )
            fix = (
                "Run `ddpdoctor report` on the run dir: it names the missing rank and shows its stack, or says "
                "that every rank is there (then suspect the comm hook, the backend or the network). "
                "Look for a collective that one rank skips or adds (a backward skipped on one rank, "
                "data-dependent control flow, an uneven last batch, an exception swallowed on one rank)."
            )
            monitor.emit(
                FindingRecord(
                    rank=monitor.rank,
                    ddp=monitor.ddp_index,
                    step=record.step,
                    code="hang",
                    severity="error",
                    title=title,
                    detail="Stack of the training thread:\n" + "\n".join(stack[-8:]),
                    fix=fix,
                    ranks=[monitor.rank],
                    evidence={
                        "phase": record.phase,
                        "waited_s": record.waited_s,
                        "pending_bucket": record.pending_bucket,
                    },
                )
            )
            warn(f"ddpdoctor: {title}. {fix}", HangWarning, stacklevel=1)
        monitor.sink.flush(timeout=2.0)
