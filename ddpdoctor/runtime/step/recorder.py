"""The per-rank step state machine: collects marks during a step, emits one Step record.

A *step* is one synchronized iteration: optional ``no_sync`` micro-steps, the synchronizing
forward, its backward with the bucket all-reduces, and whatever follows (optimizer, data) until
the next training forward starts, which closes the step. Everything here runs on the training
thread, except ``bucket_done`` (called from the communication library's thread) and
``emit_closed`` (any thread).

Closed steps are emitted together (``emit_closed``): at once when the last emission was
``BATCH_NS`` ago or more (every step of a job whose steps take that long), else with the next
step to close after that, or at ``BATCH_STEPS`` steps. Why: a step record built right after a
forward runs with cold caches at 3-4 times the cost of the same code run step after step in a
loop, and on millisecond steps that cost was most of ddpdoctor's time on the training thread.
Records keep their order: any other record a monitor emits first emits the closed steps.

Bucket marks on a clock whose marks cost the device (CUDA events): every timing event recorded
on a stream costs GPU time (measured on an H200: about 44 µs per event on a 65 ms transformer
step, +2.4% with two events per bucket; the same events without timing cost nothing), so unless
``bucket_marks_every_step`` is set, such a step marks every bucket only at the sampled steps
(``events.schedule.is_sampled``, where the compact log keeps full step records). Between them
it marks its first and last bucket ready and, instead of each bucket's completion, the end of
DDP's wait for all of them (``sync_end``): the step's phases, its arrivals for the straggler
blame and its exposed communication stay, per-bucket launch and done times are left empty.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ddpdoctor.events import BucketInfo, Layout, Record, Step
from ddpdoctor.events.schedule import DEFAULT_EVERY, is_sampled
from ddpdoctor.runtime.step.clocks import HostClock, Mark, mono_ns, wall_ns

#: Steps whose CUDA events are still in flight are kept this long before being given up.
MAX_PENDING_STEPS = 64
#: Closed steps wait for the next emission at most this long (host ns) and this many steps.
BATCH_NS = 50_000_000
BATCH_STEPS = 32
#: Longest wait for another thread's emission of closed steps (seconds).
EMIT_WAIT_S = 5.0


def _put(values: list[Any], index: int, value: Any) -> None:
    if index >= len(values):
        values.extend([None] * (index + 1 - len(values)))
    values[index] = value


#: ``OpenStep.packed``'s done mark of an all-reduce not seen complete (None in the lists)
PACKED_NONE = -(2**63)


def _before_ready(step: OpenStep, at: Mark) -> bool:
    """An optimizer event stamped (``at``, a host mark taken in C++) before any of the step's
    buckets was ready: another model's optimizer, stepped between this model's forward and its
    backward. The live hooks pass over it (the step has no bucket ready when it runs); stamps
    applied later must too, or a second model's optimizer time would be this step's."""
    if at is None:
        return False
    first = min((m for m in step.ready if m is not None), default=None)
    return first is not None and at < first


def unpack_marks(step: OpenStep) -> None:
    """Turn a step's packed bucket marks (``OpenStep.packed``) into its ready, launch and done
    lists, for the code that reads the lists (the optimizer rule, Python's record build)."""
    packed = step.packed
    if packed is None:
        return
    marks = memoryview(packed).cast("q").tolist()
    step.ready = marks[0::3]
    step.launch = marks[1::3]
    step.done = [None if m == PACKED_NONE else m for m in marks[2::3]]
    step.packed = None


class OpenStep:
    """Marks of the step in progress (plain slots: this is the hot path)."""

    __slots__ = (
        "index",
        "t0",
        "t0_mono_ns",
        "t0_wall_ns",
        "micro",
        "fwd_start",
        "fwd_end",
        "bcast",
        "bcast_bytes",
        "bwd_end",
        "ready",
        "launch",
        "done",
        "nbytes",
        "opt_start",
        "opt_end",
        "end",
        "synced_forward",
        "layout",
        "comm_hook",
        "all_marks",
        "arrived",
        "done_seen",
        "sync",
        "packed",
    )

    def __init__(self, index: int, t0: Mark) -> None:
        self.index = index
        self.t0 = t0
        self.t0_mono_ns = mono_ns()
        self.t0_wall_ns = wall_ns()
        self.micro = 0
        self.fwd_start: Mark = None
        self.fwd_end: Mark = None
        self.bcast: list[tuple[Mark, Mark, bool]] = []  # (start, end, inside the synchronizing forward)
        self.bcast_bytes = 0
        self.bwd_end: Mark = None
        self.ready: list[Mark] = []
        self.launch: list[Mark] = []
        self.done: list[Mark] = []
        self.nbytes: list[int | None] = []
        self.opt_start: Mark = None
        self.opt_end: Mark = None
        self.end: Mark = None
        self.synced_forward = False
        self.layout: dict[int, BucketInfo] | None = None
        self.comm_hook: str | None = None  # the comm hook in effect when its layout was asked for
        self.all_marks = True  # every bucket marked (False: first and last ready, and ``sync``)
        self.arrived = 0  # buckets ready so far (counted where not all are marked)
        self.done_seen: list[bool] = []  # buckets completed without a mark (not ``all_marks``)
        self.sync: Mark = None  # DDP's wait for every bucket ended (not ``all_marks``)
        #: the bucket marks of a step the routine forward drained and closed at once (the
        #: extension's ``step_changer``): int64 (ready, launch, done) per bucket, done
        #: ``PACKED_NONE`` where not seen complete; ``ready``, ``launch`` and ``done`` stay empty
        #: then. Only ``build_step`` and ``unpack_marks`` read it.
        self.packed: bytes | None = None

    def marks(self) -> list[Mark]:
        unpack_marks(self)
        out = [self.t0, self.fwd_start, self.fwd_end, self.bwd_end, self.opt_start, self.opt_end, self.end, self.sync]
        out += self.ready + self.launch + self.done
        for a, b, _ in self.bcast:
            out += (a, b)
        return out


class StepRecorder:
    """Turns probe calls into Step and Layout records for one DDP model on one rank."""

    def __init__(
        self,
        rank: int,
        ddp_index: int,
        emit: Callable[[Record], None],
        clock: Any = None,
        emit_steps: Callable[[list[Step]], None] | None = None,
    ) -> None:
        self.rank = rank
        self.ddp_index = ddp_index
        self.emit = emit
        #: several step records at once, oldest first (the batched emission); default: ``emit``
        #: each in turn
        self.emit_steps: Callable[[list[Step]], None] = emit_steps or self._emit_each
        self.clock = clock or HostClock()
        self.current: OpenStep | None = None
        self.in_forward = False  # inside a training forward (buffer broadcasts count)
        self.in_sync_forward = False
        self.in_broadcast = False  # inside DDP's buffer broadcast (read by the hang watchdog)
        self.steps_emitted = 0
        #: index the next step opened gets (``StepHooks.on_forward_pre``'s routine branch opens
        #: steps too, and advances it)
        self.next_index = 0
        #: every bucket of every step marked (host marks: they cost the device nothing); else
        #: only at the sampled steps (see the module docstring)
        self.bucket_marks_every_step = bool(self.clock.always_ready)
        self._expect_buckets = 0  # buckets of the last step that had any: the last one is marked
        #: optimizer steps begun and not ended since the current step's opt_start (an optimizer
        #: whose step runs another's, as ZeroRedundancyOptimizer runs its local one): the step's
        #: opt_end is the end that closes the first
        self._opt_depth = 0
        self._pending: list[OpenStep] = []
        #: closed steps not emitted yet (host marks): appended by the training thread (``_close``,
        #: and ``StepHooks.on_forward_pre``'s routine branch), taken by whichever thread emits
        #: them (``emit_closed``); deque append and popleft are atomic
        self.closed_steps: deque[OpenStep] = deque()
        #: host ns of the last emission of closed steps (the batch is due ``BATCH_NS`` after it)
        self.emitted_at = 0
        self._emit_lock = threading.Lock()  # one emitter at a time: steps reach the sink in order
        self._emitting = 0  # thread id of the emitter (a record it emits must not re-enter)
        self._last_layout: list[tuple[int, str]] | None = None  # (bytes, dtype) per bucket
        #: bytes per bucket of the last layout seen (empty before the first): the routine branch
        #: hands this very list to the native step change, which reuses it where equal
        self.last_bytes: list[int | None] = []
        # Layouts are looked at in the steps opened after these were set; the decision is taken
        # when a step opens, not when the step before is emitted (closed steps wait for that)
        self._layout_wanted = False  # bucket sizes moved: look at the next step's
        self._layout_steps = 2  # DDP builds its buckets, then rebuilds them once after step 0
        self.comm_hook: str | None = None  # the user's comm hook in effect (None: DDP's default)
        self._hook_asked: str | None = None  # the comm hook of the last step that captured a layout
        #: the next step opened captures a layout (``_update_layout_next``; the monitor's routine
        #: forward reads this one attribute)
        self.layout_next = True
        self._last_hook: str | None = None  # the one the last Layout record named
        #: the native extension's ``build_step`` (None: Python builds the records): a host-clock
        #: step's record built in C++, equal to the one ``_record`` builds
        self.build_step: Callable[..., Step] | None = None

    def layout_bytes(self) -> list[int | None]:
        """Bytes per bucket of the last layout seen (empty before the first)."""
        return list(self.last_bytes)

    def set_comm_hook(self, name: str | None) -> None:
        """A comm hook now in effect (registered after ``instrument``): the next layout names it."""
        self.comm_hook = name  # the next step opened captures the layout, naming it
        self._update_layout_next()

    def reset_layout(self) -> None:
        """A new DDP instance: its buckets are new, look at them again."""
        self._last_layout = None
        self.last_bytes = []
        self._layout_steps = 1
        self._update_layout_next()

    def _update_layout_next(self) -> None:
        """``layout_next`` from what asks for a layout: the first steps of a DDP instance, bucket
        sizes that moved, a comm hook not named in a layout yet."""
        self.layout_next = bool(self._layout_steps or self._layout_wanted or self.comm_hook != self._hook_asked)

    # -- forward ---------------------------------------------------------------------------

    def forward_start(self, sync: bool) -> OpenStep:
        """Open (or continue) the step this forward belongs to, and return it.

        ``StepHooks.on_forward_pre`` runs this and ``_close`` unrolled for the routine forward
        (host marks, nothing pending, a synchronizing step after a synchronizing one): a change
        here is made there too (``tests/test_routine_forward.py`` compares the two)."""
        now = self.clock.now()
        step = self.current
        opened = None
        if step is not None and (step.ready or (sync and step.synced_forward)):
            if step.opt_start is not None and step.opt_end is None:
                # an optimizer step that runs a closure (Lightning): its pre-hook came before
                # this forward, which belongs to it; optimizer_end places the step's start
                step.opt_start = None
            # opened before the close: its monotonic and wall anchors are read now, with its
            # start, not after a batch the close may emit (hundreds of µs under load: every
            # time of the step would be placed that much late on the aligned clock)
            opened = OpenStep(self.next_index, now)
            self._close(step, now)
            step = None
        if step is None:
            step = self.current = opened if opened is not None else OpenStep(self.next_index, now)
            self.next_index += 1
            if not self.bucket_marks_every_step:
                step.all_marks = is_sampled(step.index, DEFAULT_EVERY)
            if self.layout_next:
                step.layout = {}
                step.comm_hook = self._hook_asked = self.comm_hook
                self._layout_wanted = False
                if self._layout_steps:
                    self._layout_steps -= 1
                self._update_layout_next()
        if sync:
            step.fwd_start = now
            step.synced_forward = True
        else:
            step.micro += 1
        self.in_forward = True
        self.in_sync_forward = sync
        return step

    def forward_end(self) -> None:
        """The forward ended: the synchronizing forward's end is stamped (the monitor's forward
        post-hook runs the same, unrolled)."""
        if self.in_sync_forward and self.current is not None:
            self.current.fwd_end = self.clock.now()
        self.in_forward = False
        self.in_sync_forward = False

    def buffers_broadcast(self, start: Mark, end: Mark, nbytes: int) -> None:
        step = self.current
        if self.in_forward and step is not None:
            # After a no_sync micro-step DDP skips the broadcast in the synchronizing forward:
            # the step's broadcast then happened in the micro-step, and still counts.
            step.bcast.append((start, end, self.in_sync_forward))
            step.bcast_bytes += nbytes

    # -- backward / buckets ----------------------------------------------------------------

    def bucket_ready(self, index: int, bucket: Any) -> OpenStep | None:
        """Called first thing in the comm hook; returns the step the bucket belongs to."""
        step = self.current
        if step is None or not step.synced_forward:
            return None
        if step.all_marks:
            now = self.clock.now()
        else:  # the first bucket to arrive, and the one that makes the last step's count
            step.arrived += 1
            now = self.clock.now() if step.arrived == 1 or step.arrived >= self._expect_buckets else None
        nbytes = bucket.buffer().nbytes
        if index == len(step.ready):  # buckets arrive in index order: the common case
            step.ready.append(now)
            step.nbytes.append(nbytes)
        else:
            _put(step.ready, index, now)
            _put(step.nbytes, index, nbytes)
        return step

    def is_first_bucket(self, step: OpenStep) -> bool:
        return sum(m is not None for m in step.ready) == 1

    def bucket_launched(self, step: OpenStep, index: int) -> None:
        clock = self.clock
        # A CUDA event here would sit on the gradient's stream right behind the ready one (the
        # launch itself is host work, the all-reduce runs on its own stream): it would measure
        # nothing the device did and cost an event and its resolution per bucket. The ready
        # one is reused (None for a bucket left unmarked between the sampled steps).
        now = step.ready[index] if not clock.always_ready and index < len(step.ready) else clock.now()
        if index == len(step.launch):
            step.launch.append(now)
        else:
            _put(step.launch, index, now)

    def bucket_done(self, step: OpenStep, index: int) -> None:
        if step.all_marks:
            _put(step.done, index, self.clock.now())  # any order: completions race on gloo's threads
        else:
            _put(step.done_seen, index, True)  # (for the hang report: which buckets completed)

    def sync_end(self, step: OpenStep) -> None:
        """DDP's wait for every bucket's all-reduce ended (a step that marks only some buckets:
        called from an autograd callback that runs after DDP's finalization)."""
        if step.sync is None and not step.all_marks:
            step.sync = self.clock.now()

    def add_bucket_columns(
        self,
        step: OpenStep,
        indices: list[int],
        ready: list[int],
        launch: list[int],
        done: list[int | None],
        nbytes: list[int],
        in_order: bool,
    ) -> None:
        """Per-bucket marks taken elsewhere (the native comm hook's ring), handed over at once
        as columns, host-clock ns (done None: not seen). ``in_order``: ``indices`` is 0, 1, 2..."""
        if in_order and len(indices) >= len(step.ready):
            # every bucket once, in index order (the common case); a drain holds every mark
            # handed over before, and later ones: the lists are taken whole
            step.ready, step.launch, step.done, step.nbytes = ready, launch, done, nbytes  # type: ignore[assignment]
            return
        for index, r, la, d, b in zip(indices, ready, launch, done, nbytes, strict=True):
            _put(step.ready, index, r)
            _put(step.launch, index, la)
            _put(step.done, index, d)
            _put(step.nbytes, index, b)

    def bucket_layout(self, step: OpenStep, index: int, info: BucketInfo) -> None:
        if step.layout is not None:
            step.layout[index] = info

    def backward_end(self, step: OpenStep, at: Mark = None) -> None:
        """Backward compute ended now, or ``at`` (a host-clock mark taken elsewhere)."""
        if step.bwd_end is None:
            step.bwd_end = self.clock.now() if at is None else at

    # -- optimizer -------------------------------------------------------------------------

    def optimizer_start(self, at: Mark = None) -> None:
        """An optimizer step starts now, or ``at`` (a host mark taken in C++: the native route)."""
        step = self.current
        if step is None or not step.ready or _before_ready(step, at):
            return
        if step.opt_start is None:
            step.opt_start = self.clock.now() if at is None else at
            self._opt_depth = 1
        elif step.opt_end is None:
            self._opt_depth += 1  # an optimizer step inside the first (a wrapper's inner optimizer)

    def optimizer_end(self, at: Mark = None) -> None:
        """An optimizer step ends now, or ``at`` (as ``optimizer_start``)."""
        step = self.current
        if step is None or step.opt_end is not None or _before_ready(step, at):
            return
        if step.opt_start is not None and self._opt_depth > 1:
            self._opt_depth -= 1  # an inner optimizer step ended: the first goes on
            return
        if step.opt_start is None and step.ready and self.clock.always_ready:
            # optimizer.step(closure): the closure ran this step's forward and backward inside
            # the optimizer step; its own work began when the closure returned, after the
            # backward and its all-reduces (host marks: the latest of them)
            step.opt_start = max((m for m in (step.bwd_end, *step.done) if m is not None), default=None)
        if step.opt_start is not None:
            step.opt_end = self.clock.now() if at is None else at

    # -- emission --------------------------------------------------------------------------

    def close(self, wait_s: float = 0.0) -> None:
        """End of monitoring: emit the open step (its duration unknown) and anything pending.

        With CUDA marks, the last steps' events may not have been passed yet: ``wait_s`` bounds
        how long to poll them (``query()``, never a device synchronization) so a clean end keeps
        their timings; a step still unresolved then keeps what the host knows."""
        if self.current is not None and self.current.synced_forward:
            self._close(self.current, None)
        self.current = None
        self.emit_closed()
        if wait_s > 0 and self._pending:
            deadline = time.monotonic() + wait_s
            ready = self.clock.ready
            while not all(ready(s.marks()) for s in self._pending) and time.monotonic() < deadline:
                time.sleep(0.001)
        self._drain(force=True)

    @property
    def steps_closed(self) -> int:
        """Steps closed so far: emitted, or closed and waiting for the next emission."""
        return self.steps_emitted + len(self.closed_steps)

    @property
    def closed_waiting(self) -> bool:
        """Closed steps wait for their emission."""
        return bool(self.closed_steps)

    def closed_age_ns(self, now: int) -> int:
        """How long ago closed steps were last emitted (host ns), when some wait; else 0."""
        return now - self.emitted_at if self.closed_steps else 0

    def emit_closed(self, at: Mark = None) -> None:
        """Emit the closed steps, oldest first, ``at`` (a host mark; None: now). Any thread; a
        call made while this thread already emits them (a record that emission emits) returns."""
        me = threading.get_ident()
        if self._emitting == me or not self.closed_steps:
            return
        # bounded: an emitter stuck in a sink must not stop the hang watchdog's report (the
        # steps then wait for the next emission)
        if not self._emit_lock.acquire(timeout=EMIT_WAIT_S):
            return
        self._emitting = me
        try:
            self.emitted_at = mono_ns() if at is None else at
            closed = self.closed_steps
            records: list[Step] = []
            # host marks built in C++ (the native route) are called here, not through _record,
            # and a step whose bytes list is the last layout's own (the routine forward's) and has no
            # layout needs no _layout_due: no Python frame a step, most batches
            build = self.build_step if self.clock.always_ready else None
            rank, ddp, clock_name = self.rank, self.ddp_index, self.clock.name
            try:
                while closed:
                    step = closed.popleft()
                    record = self._record(step, True) if build is None else build(step, Step, rank, ddp, clock_name)
                    if (step.layout is not None or step.nbytes is not self.last_bytes) and self._layout_due(step):
                        self._hand_over(records)  # the steps before it, then the layout, then its step
                        records = []
                        self._emit_layout(step)
                    records.append(record)
            finally:  # (what was built goes out even if a later record failed)
                self._hand_over(records)
        finally:
            self._emitting = 0
            self._emit_lock.release()

    def _close(self, step: OpenStep, end: Mark) -> None:
        step.end = end
        self.current = None
        if step.ready:
            self._expect_buckets = len(step.ready)
        if self.clock.always_ready and not self._pending:
            # host marks: nothing to wait for; emitted with the closed steps before it
            closed = self.closed_steps
            closed.append(step)
            if (
                end is None
                or len(closed) >= BATCH_STEPS
                or end - self.emitted_at >= BATCH_NS
                or self.steps_emitted == 0
            ):
                self.emit_closed(end)
            return
        self._pending.append(step)
        self._drain(force=False)

    def _drain(self, force: bool) -> None:
        clock = self.clock
        while self._pending:
            step = self._pending[0]
            resolved = clock.always_ready or clock.ready(step.marks())
            if not resolved and not force and len(self._pending) < MAX_PENDING_STEPS:
                return
            self._pending.pop(0)
            self._emit_step(step, resolved)

    def _emit_each(self, records: list[Step]) -> None:
        for record in records:
            self.emit(record)

    def _hand_over(self, records: list[Step]) -> None:
        """Emit closed steps' records together (one call into the sink and the live checks, not
        one a step: the batched emission's point)."""
        if records:
            # counted before they are handed over: a signal handler that closes the monitor
            # (SIGTERM) can run inside the emission, and its End record must count them
            self.steps_emitted += len(records)
            self.emit_steps(records)

    def _layout_due(self, step: OpenStep) -> bool:
        """A layout to look at, or one that moved (most steps: neither)."""
        return step.layout is not None or (self._last_layout is not None and step.nbytes != self.last_bytes)

    def _emit_step(self, step: OpenStep, resolved: bool | None = None) -> None:
        """Emit ``step``'s record. ``resolved``: whether the device has passed all its marks,
        when the caller has just asked (None: ask here; each ask queries every mark)."""
        clock = self.clock
        if resolved is None:
            resolved = clock.always_ready or clock.ready(step.marks())
        record = self._record(step, resolved)
        if self._layout_due(step):
            self._emit_layout(step)
        # counted before it is handed over: a signal handler that closes the monitor (SIGTERM)
        # can run inside emit, after the sink took the record (the live checks come after it),
        # and its End record must count this step
        self.steps_emitted += 1
        self.emit(record)
        if resolved and not clock.always_ready:
            # not the step's end: that event is the next step's start, still open
            end = step.end
            clock.recycle([m for m in step.marks() if m is not end])

    def _record(self, step: OpenStep, resolved: bool) -> Step:
        """``step``'s record (``resolved``: the device has passed all its marks)."""
        clock = self.clock
        build = self.build_step
        if build is not None and clock.always_ready:
            return build(step, Step, self.rank, self.ddp_index, clock.name)
        unpack_marks(step)  # (the routine forward packs marks only where build_step builds its records)
        if not resolved:  # the GPU never passed these events in time: keep what the host knows
            record = Step(
                rank=self.rank,
                ddp=self.ddp_index,
                step=step.index,
                t0_mono_ns=step.t0_mono_ns,
                t0_wall_ns=step.t0_wall_ns,
                micro=step.micro,
                # per-bucket lists hold None for a bucket not seen this step (``_put`` pads): the
                # schema's element types do not say so; readers skip None
                b_bytes=step.nbytes,  # type: ignore[arg-type]
                bcast_bytes=step.bcast_bytes,
                clock=clock.name,
            )
        else:
            # This runs on the training thread at every step: the marks are turned into offsets
            # from t0 a list at a time (``rel_us``), not one call per mark.
            rel = clock.rel_us
            t0 = step.t0
            fwd_start, fwd_end = step.fwd_start, step.fwd_end
            fwd_start_us, fwd_end_us, bwd_end_us, opt_start_us, opt_end_us, end_us = rel(
                t0, (fwd_start, fwd_end, step.bwd_end, step.opt_start, step.opt_end, step.end)
            )
            bcast_us = fwd_us = sync_end = None
            bcast_start = None
            bcast = step.bcast
            # us() is None only for a missing mark: broadcast marks come in pairs, and fwd_start and
            # fwd_end are checked below, so these sums and differences are of floats
            if bcast:
                us = clock.us
                bcast_us = sum(us(a, b) for a, b, _ in bcast)  # type: ignore[misc]
                bcast_start = us(t0, bcast[0][0])
            if fwd_start is not None and fwd_end is not None:
                fwd_us = clock.us(fwd_start, fwd_end)
                if bcast:  # less the broadcasts inside the synchronizing forward
                    fwd_us -= sum(clock.us(a, b) for a, b, sync in bcast if sync)  # type: ignore[misc, operator]
            done = rel(t0, step.done)
            ready_us = rel(t0, step.ready)
            if done and None not in done:
                sync_end = max(done)  # None was ruled out just above
            elif step.sync is not None:
                sync_end = clock.us(t0, step.sync)
            record = Step(
                rank=self.rank,
                ddp=self.ddp_index,
                step=step.index,
                t0_mono_ns=step.t0_mono_ns,
                t0_wall_ns=step.t0_wall_ns,
                micro=step.micro,
                fwd_start_us=fwd_start_us or 0.0,
                fwd_us=fwd_us,
                bcast_start_us=bcast_start,
                bcast_us=bcast_us,
                bcast_bytes=step.bcast_bytes,
                fwd_end_us=fwd_end_us,
                bwd_end_us=bwd_end_us,
                # per-bucket lists hold None for a bucket not seen (``_put`` pads) or not marked
                b_ready_us=ready_us,
                b_launch_us=list(ready_us) if step.launch == step.ready else rel(t0, step.launch),
                b_done_us=done,
                # the step is closed: its lists are handed over, not copied
                b_bytes=step.nbytes,  # type: ignore[arg-type]
                sync_end_us=sync_end,
                opt_start_us=opt_start_us,
                opt_end_us=opt_end_us,
                end_us=end_us,
                clock=clock.name,
            )
        return record

    def _emit_layout(self, step: OpenStep) -> None:
        if step.layout:
            buckets = [step.layout[i] for i in sorted(step.layout)]
            signature = [(b.bytes, b.dtype) for b in buckets]
            if signature != self._last_layout or (step.comm_hook != self._last_hook):
                if self._last_layout is None:
                    reason = "initial"
                elif signature == self._last_layout:
                    reason = "comm_hook"  # same buckets, another hook registered since
                elif step.index <= 1:
                    reason = "rebuilt"
                else:
                    reason = "changed"
                self.emit(
                    Layout(
                        rank=self.rank,
                        ddp=self.ddp_index,
                        step=step.index,
                        reason=reason,
                        buckets=buckets,
                        comm_hook=step.comm_hook,
                    )
                )
                self._last_layout = signature
                self._last_hook = step.comm_hook
                self.last_bytes = [b.bytes for b in buckets]
        elif self._last_layout is not None and step.nbytes != self.last_bytes:
            self._layout_wanted = True  # bucket sizes moved: capture names on the next step
            self.layout_next = True
