"""``StepHooks``: every callback torch and the comm library make into ddpdoctor at every step.

Forward pre and post hooks, the buffer-broadcast wrapper, bucket ready (from the comm hook), the
backward-end callbacks, the optimizer's hooks and stamps, and the emission of the records they
produce. Each probe is one Python frame: after the backward and the optimizer step every function
entered is cold and costs a microsecond or two whatever it does (``bench/hot_path.py``), so the
routine forward runs ``StepRecorder.forward_start``, ``SampledChecks.on_step_start`` and
``NativeTiming.on_sync_forward`` unrolled, on their documented public fields. A change to one of
those is made here too; ``tests/test_routine_forward.py`` compares the two paths record by record.

The ``Monitor`` (``runtime.monitor``) makes one ``StepHooks`` with its sink, and gives it its
checks at every attach (``attached``); it keeps the options, the attach and the close.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from ddpdoctor.events import Fingerprint, ProcSample, Record, Step, Unused
from ddpdoctor.events.schedule import is_sampled
from ddpdoctor.runtime import torch_compat
from ddpdoctor.runtime.step import clocks, native_hook
from ddpdoctor.runtime.step.clocks import mono_ns
from ddpdoctor.runtime.step.recorder import BATCH_NS, BATCH_STEPS, OpenStep, StepRecorder, unpack_marks

if TYPE_CHECKING:
    import torch.distributed as dist

    from ddpdoctor.runtime.checks.live_findings import LiveFindings
    from ddpdoctor.runtime.checks.nonfinite import NonFiniteWatch
    from ddpdoctor.runtime.checks.sampled import SampledChecks
    from ddpdoctor.runtime.checks.unsynced import UnsyncedUpdates
    from ddpdoctor.runtime.probes import Probes
    from ddpdoctor.sinks import Sink

_perf_ns = time.perf_counter_ns  # own_ns accounting: one lookup less per call on the hot path
_SYS_MODULES = sys.modules

#: How often the buffer byte count is recomputed (buffers are rarely replaced).
_BUFFER_BYTES_EVERY = 100
#: Closed steps that waited this long (host ns) are emitted by a process sample.
_STALE_NS = 1_000_000_000
#: Records emitted without the closed steps going out first: the log reads them in any order
#: relative to the steps (``sinks.compact``'s pass-through records; readers file them by kind).
#: A sampled check emits one as its sample begins (the fingerprint) and one as it ends (the
#: unused parameters): each would otherwise split the batch of closed steps, two emissions more
#: a sample.
_UNORDERED = (Step, Fingerprint, Unused)


class StepHooks:
    """The probes of one monitored DDP model on one rank, and the records' way to the sink.

    Public fields, read by the monitor, the watchdog and the native side: ``recorder``,
    ``probes``, ``sink``, ``live``, ``closed``, ``own_ns``; set at each attach (``attached``):
    ``checks``, ``nonfinite``, ``unsynced``, ``native``.
    """

    #: the forward after a routine step takes ``on_forward_pre``'s routine branch (False: always
    #: the full path; read by ``_routine_possible``, so set it before the monitor's first forward;
    #: the tests compare the two)
    routine_forward = True

    def __init__(
        self,
        rank: int,
        ddp_index: int,
        sink: Sink,
        probes: Probes,
        clock: Any,
        cuda: bool,
        check_every: int,
        every_bucket: bool = False,
    ) -> None:
        """``every_bucket``: every bucket's marks at every step (the full log asked for)."""
        self.rank = rank
        self.ddp_index = ddp_index
        self.sink = sink
        self.probes = probes
        self.cuda = cuda
        self.check_every = check_every
        #: the monitor closed (or went quiet in a forked child): the hooks left record nothing
        self.closed = False
        #: ddpdoctor's own time (ns) in its training-thread callbacks: forward hooks, the buffer
        #: broadcast wrapper less the broadcast, bucket ready, optimizer (the native side adds its
        #: drain); steps, checks and live findings
        self.own_ns = 0
        self.recorder = StepRecorder(rank, ddp_index, self.emit, clock, self.emit_steps)
        self._backward_end_ok = torch_compat.available("backward_end")
        if every_bucket or not self._backward_end_ok:
            # every step's detail asked for, or no callback to mark the sync end with:
            # every bucket's marks at every step
            self.recorder.bucket_marks_every_step = True
        #: the live findings (the monitor makes them with this object's ``emit``)
        self.live: LiveFindings = None  # type: ignore[assignment]
        self.checks: SampledChecks | None = None
        self.nonfinite: NonFiniteWatch | None = None
        self.unsynced: UnsyncedUpdates | None = None
        #: the native hook's per-step side, run from these hooks (None: the Python route)
        self.native: native_hook.NativeTiming | None = None
        self.opt_stamps: Any = None  # the C++ optimizer hooks' (``optimizer_stamps``)
        self._opt_take_into: Any = None  # its ``take_into``, read once (a plain C function)
        self._nf_word: Any = None
        self._bwd_queued: OpenStep | None = None
        self._param_names: dict[int, str] = {}
        self._buffer_bytes = 0
        self._buffer_bytes_age = _BUFFER_BYTES_EVERY

    def attached(
        self,
        checks: SampledChecks,
        nonfinite: NonFiniteWatch,
        unsynced: UnsyncedUpdates,
        native: native_hook.NativeTiming | None,
        param_names: dict[int, str],
    ) -> None:
        """A DDP instance attached (first, or after a rewrap): its checks, and its native side
        (None: the Python route)."""
        self.native = native
        self.nonfinite = nonfinite
        self._nf_word = nonfinite.word
        self._param_names = param_names
        self._buffer_bytes = 0
        self._buffer_bytes_age = _BUFFER_BYTES_EVERY
        self.checks = checks
        self.unsynced = unsynced

    def quiet(self) -> None:
        """This copy goes quiet for good (a forked child): closed, every probe off, no stamps."""
        self.closed = True
        for name in self.probes.NAMES:
            self.probes.switch_off(name)
        self.native = None
        self.opt_stamps = None

    # -- records -------------------------------------------------------------------------

    def emit(self, record: Record) -> None:
        """Hand a record to the sink and to the live checks (never raises).

        Closed steps waiting for their emission go first, so the log keeps its order, except
        before the records it reads in any order (``_UNORDERED``: a sampled check's). A process
        sample (the sampler's thread, every few seconds) takes them only once they have waited
        ``_STALE_NS``: a job paused between steps (evaluation, a checkpoint) then shows its last
        steps, while the steps of a running job are emitted by the training thread.
        """
        if type(record) not in _UNORDERED:
            recorder = self.recorder
            if recorder.closed_waiting and (
                type(record) is not ProcSample or recorder.closed_age_ns(mono_ns()) >= _STALE_NS
            ):
                try:
                    recorder.emit_closed()
                except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                    self.probes.failed("emit", exc)
        if self.probes.on["emit"]:
            try:
                self.sink.emit(record)
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                self.probes.failed("emit", exc)
        if self.probes.on["live"]:
            try:
                self.live.observe(record)
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                self.probes.failed("live", exc)

    def emit_steps(self, records: list[Step]) -> None:
        """Hand closed steps' records, oldest first, to the sink and to the live checks, each in
        one call (the recorder's batched emission; never raises). ``emit`` of each in turn would
        do the same, a call or two more per step."""
        if self.probes.on["emit"]:
            try:
                # (ddpdoctor's own sinks all have it; a sink of the user's is behind
                # ``PlainColumns``, which falls back to its ``emit`` where it has no ``emit_many``)
                self.sink.emit_many(records)
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                self.probes.failed("emit", exc)
        if self.probes.on["live"]:
            try:
                self.live.observe_steps(records)
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                self.probes.failed("live", exc)

    # -- forward (hot path) --------------------------------------------------------------

    def on_forward_pre(self, module: Any, args: Any) -> None:
        """Every forward: close the step before (emitting it), open this one, run the checks.

        The forward after a routine step is done here in one frame (below); any other takes
        ``_forward_pre``, the full path. Why one frame: after the backward and the optimizer step
        every function entered is cold, and each costs a microsecond or two whatever it does
        (``bench/hot_path.py``).

        Routine: a synchronizing training forward after a synchronizing step on the native route,
        every probe on, host marks, no layout to capture, no sample in progress (one may begin),
        nothing of compiled autograd. That is most forwards of most jobs; the full path is the
        rule, this is the same rule unrolled for that case (``tests/test_routine_forward.py`` runs
        both over the same steps and compares every record). Where the ring's buckets came out of
        order, or the optimizer's stamps hold no start then end after the step's first bucket, it
        applies them the full path's way and hands over to the full path. What of the rule never
        changes back once it holds (the C++ optimizer stamps, the one-call requires_grad check, the
        change of step in one C call, host marks for every bucket) is asked on the full path
        (``_routine_possible``, into ``NativeTiming.routine``): every condition read here costs a
        cold read of its own.
        """
        if self._nf_word.value:  # a bucket of the backward before was not finite
            self.nonfinite_found(self.recorder.current)
        native = self.native
        if native is not None and native.routine and native.pending:
            recorder = self.recorder
            step = recorder.current
            checks: Any = self.checks
            compiled = _SYS_MODULES.get(torch_compat.COMPILED_AUTOGRAD_MODULE)
            if (
                step is not None
                and step.synced_forward
                and self.probes.all_on
                and self.live.error is None
                and not recorder.layout_next
                and torch.is_grad_enabled()
                and module.require_backward_grad_sync
                and (compiled is None or not getattr(compiled, "compiled_autograd_enabled", False))
                and (native.asked_in > 1 or native.routine_config())
            ):
                t = _perf_ns()
                offset = clocks.OFFSET_NS
                routine = True
                try:
                    index = recorder.next_index
                    # in one C call (set: ``_routine_possible``): the ring's marks into the step, packed
                    # (OpenStep.packed; the bytes list the last layout's where equal), the optimizer's
                    # stamps, the step ended now, and OpenStep(index, now), synchronizing, opened
                    new = native.step_change(step, index, offset, recorder.last_bytes)
                    native.pending = False
                    if new.__class__ is not OpenStep:  # the columns (out of order) or the optimizer's events
                        if new.__class__ is tuple:
                            native.apply_columns(self, step, new)
                        else:  # (the optimizer rule reads the step's lists)
                            unpack_marks(step)
                            self.apply_optimizer_events(new)
                        routine = False  # the full path goes on from there
                    else:
                        # StepRecorder._close with host marks, none pending (set: ``_routine_possible``;
                        # _expect_buckets serves only steps that do not mark every bucket): the step
                        # waits for the batched emission. (A test may shift the host clock:
                        # clocks.TEST_OFFSET_ENV; the offset is the C call's.)
                        now = new.t0
                        recorder.current = None
                        closed = recorder.closed_steps
                        closed.append(step)
                        if (
                            len(closed) >= BATCH_STEPS
                            or now - recorder.emitted_at >= BATCH_NS
                            or not recorder.steps_emitted
                        ):
                            recorder.emit_closed(now)
                        # StepRecorder.forward_start, synchronizing, on a synchronizing step
                        recorder.current = new
                        recorder.next_index = index + 1
                        recorder.in_forward = True
                        recorder.in_sync_forward = True
                        checks.bcast_in_forward = False
                        # NativeTiming.on_sync_forward, nothing changed since the last one
                        native.asked_in -= 1
                        native.pending = True
                except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                    self.probes.failed("forward", exc)
                else:
                    if routine:
                        try:
                            if checks.sample is not None or checks.void_samples or checks.fingerprinter.pending:
                                checks.on_step_start(index, new.t0_mono_ns, True, True)  # a sample to end
                            else:  # SampledChecks.on_step_start with nothing of a sample pending
                                # (set: ``_routine_possible`` holds for a routine forward)
                                if not checks.same_flags(checks.params, checks.flag_bytes):
                                    checks.check_grad_flags(index)
                                if index >= checks.next_sample:  # (the schedule's next step, not a call a step)
                                    checks.sample_if_due(index, new.t0_mono_ns)
                        except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                            self.probes.failed("checks", exc)
                self.own_ns += _perf_ns() - t
                if routine:
                    if self.live.error is not None:
                        self._raise_live_error()
                    return
        self._forward_pre(module, native)

    def _forward_pre(self, module: Any, native: Any) -> None:
        """``on_forward_pre``'s full path: every forward that is not routine."""
        if native is not None and native.pending:
            # the last backward's stamps (native route) belong to the step this forward closes
            native.drain(self.recorder.current)
        t = _perf_ns()
        if self.opt_stamps is not None:
            self.take_optimizer()  # then its optimizer step's (after the buckets: the rule reads them)
        on = self.probes.on
        checks: Any = self.checks
        if on["forward"] and torch.is_grad_enabled():
            sync = bool(module.require_backward_grad_sync)
            recorder = self.recorder
            try:
                previous = recorder.current
                step = recorder.forward_start(sync)
                checks.bcast_in_forward = False
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                self.probes.failed("forward", exc)
            else:
                if sync and self.cuda and not self.nonfinite.reported:  # type: ignore[union-attr]
                    self._nonfinite_poll(step.index)
                if sync and native is not None:
                    native.on_sync_forward(step, self)  # (the native route's side of it)
                    if native.routine and not self._routine_possible():
                        native.routine = False
                if on["checks"]:
                    try:
                        # weights changed after a backward inside no_sync (read around no_sync forwards only)
                        unsynced: Any = self.unsynced
                        if not sync or unsynced.noted is not None:
                            ever = recorder.steps_closed > 0 or bool(step.ready)
                            found = unsynced.on_forward(sync, step.index, ever)
                            if found is not None:
                                self.live.raise_findings([found])
                        checks.on_step_start(step.index, step.t0_mono_ns, sync, step is not previous)
                    except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                        self.probes.failed("checks", exc)
        self.own_ns += _perf_ns() - t
        if self.live.error is not None:
            self._raise_live_error()

    def _routine_possible(self) -> bool:
        """What the routine forward (``on_forward_pre``) needs besides the native side's, and
        that never goes away once it holds: the optimizer stamped in C++, the requires_grad
        check in one call (a rewrap's checks get it from the same extension), the change of step
        in one C call (``NativeTiming.step_change``: it opens the next step too), the record built
        in C++ (it reads the packed marks of the change), host marks on every bucket (so no step
        waits for its marks: ``StepRecorder._pending`` stays empty)."""
        recorder = self.recorder
        native = self.native
        return (
            self.routine_forward
            and native is not None
            and self.opt_stamps is not None
            and self.checks is not None
            and self.checks.same_flags is not None
            and recorder.build_step is not None  # (packed marks: only build_step reads them)
            and native.bind_step_change(self.opt_stamps)
            and recorder.clock.always_ready
            and recorder.bucket_marks_every_step
        )

    def _raise_live_error(self) -> None:
        """A finding whose category the user's warnings filter makes an error
        (``filterwarnings("error", category=StaleRequiresGradWarning)``): raised from the forward's
        own call, once every record is taken and nothing of ours is half done."""
        error, self.live.error = self.live.error, None
        if error is not None:
            raise error

    def on_forward_post(self, module: Any, args: Any, output: Any) -> None:
        """Every forward's end (also one that raised: ``output`` None). On the native route the
        output is hooked only where compiled autograd may trace the backward
        (``NativeTiming.python_end``: the backward's end is stamped from Python then)."""
        if self.probes.on["forward"]:
            t = _perf_ns()
            recorder = self.recorder
            sync = recorder.in_sync_forward
            try:
                # StepRecorder.forward_end, unrolled: every forward, and a frame entered here costs
                # a microsecond of cold caches whatever it does
                step = recorder.current
                if sync and step is not None:
                    step.fwd_end = recorder.clock.now()
                recorder.in_forward = recorder.in_sync_forward = False
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                self.probes.failed("forward", exc)
            native = self.native
            if sync and native is not None and native.python_end and output is not None:
                native.arm_python(recorder.current, output, self)
            self.own_ns += _perf_ns() - t

    def on_sync_buffers(self, bind: Any, ddp_ref: Any) -> Any:
        """DDP's buffer broadcast (``bind(ddp)()``: DDP's ``_sync_buffers``, bound to the model
        ``ddp_ref`` holds weakly), timed apart from the forward around it. Every forward of a
        model that broadcasts buffers: one frame, as ``on_forward_post`` is (a frame entered costs
        a microsecond of cold caches; the shadow calling it is a ``partial``: see ``Attachment``)."""
        ddp = ddp_ref()
        original = bind(ddp)
        checks = self.checks
        if checks is not None:
            checks.broadcasts += 1  # the fingerprints leave out what the broadcasts bump
            # after this forward the buffers are rank 0's copy on every rank where the module
            # does not update them (eval mode: BatchNorm keeps its statistics), with grad on or
            # off; in train mode each rank updates its own right after. The final fingerprint
            # must know which (an evaluation pass after the last step). (``_modules``, not
            # ``ddp.module``: nn.Module's ``__getattr__`` is a Python frame.)
            module = ddp._modules.get("module") if ddp is not None else None
            checks.buffers_from_broadcast = module is not None and not module.training
        recorder = self.recorder
        if not (self.probes.on["buffers"] and recorder.in_forward):
            return original()
        t = _perf_ns()
        clock = recorder.clock
        try:
            start = clock.now()
        except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
            self.probes.failed("buffers", exc)
            return original()
        recorder.in_broadcast = True
        t_in = _perf_ns()
        try:
            original()
        finally:
            recorder.in_broadcast = False
        t_out = _perf_ns()
        try:
            end = clock.now()
            if checks is not None:
                checks.bcast_in_forward = True
            age = self._buffer_bytes_age + 1
            if age >= _BUFFER_BYTES_EVERY and ddp is not None:
                self._buffer_bytes = sum(b.numel() * b.element_size() for b in ddp.modules_buffers)
                age = 0
            self._buffer_bytes_age = age
            # StepRecorder.buffers_broadcast, unrolled (in_forward: read above)
            step = recorder.current
            if step is not None:
                # After a no_sync micro-step DDP skips the broadcast in the synchronizing forward:
                # the step's broadcast then happened in the micro-step, and still counts.
                step.bcast.append((start, end, recorder.in_sync_forward))
                step.bcast_bytes += self._buffer_bytes
        except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
            self.probes.failed("buffers", exc)
        self.own_ns += _perf_ns() - t - (t_out - t_in)
        return None

    # -- backward ------------------------------------------------------------------------

    def on_bucket_ready(self, bucket: dist.GradBucket, index: int) -> OpenStep | None:
        """First thing in the comm hook: ready time, bytes, layout sample, backward-end callback."""
        t = time.perf_counter_ns()
        try:
            return self._bucket_ready(bucket, index)
        finally:
            self.own_ns += time.perf_counter_ns() - t

    def _bucket_ready(self, bucket: dist.GradBucket, index: int) -> OpenStep | None:
        step = self.recorder.bucket_ready(index, bucket)
        if step is None:
            return None
        if step.layout is not None and self.probes.on["layout"]:
            try:
                from ddpdoctor.runtime.step.comm_hook import bucket_info

                self.recorder.bucket_layout(step, index, bucket_info(bucket, self._param_names))
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                self.probes.failed("layout", exc)
        if self._bwd_queued is not step and self._backward_end_ok and self.probes.on["backward_end"]:
            self._bwd_queued = step
            try:
                # Final callbacks run when the autograd graph is done, before DDP's own
                # finalization waits for the all-reduces: that instant is "backward compute end".
                torch_compat.queue_backward_callback(lambda: self._on_backward_end(step))
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                self.probes.failed("backward_end", exc)
        return step

    def _on_backward_end(self, step: OpenStep) -> None:
        try:
            self.recorder.backward_end(step)
            if not step.all_marks:
                # Queued from inside a final callback, it runs after the ones queued before it,
                # DDP's finalization among them: DDP has then made the stream wait for every
                # bucket's all-reduce, and a mark there is the step's communication end.
                torch_compat.queue_backward_callback(lambda: self._on_sync_end(step))
        except Exception as exc:  # noqa: BLE001 - it would surface inside loss.backward(); it must never break training
            self.probes.failed("backward_end", exc)

    def _on_sync_end(self, step: OpenStep) -> None:
        try:
            self.recorder.sync_end(step)
        except Exception as exc:  # noqa: BLE001 - it would surface inside loss.backward(); it must never break training
            self.probes.failed("backward_end", exc)

    def nonfinite_found(self, step: OpenStep | None) -> None:
        """The word says a bucket was not finite: this rank's first non-finite step (the step
        whose backward found it: the one open) is raised, and nothing more is looked at."""
        t = _perf_ns()
        watch: Any = self.nonfinite
        try:
            index = step.index if step is not None else max(self.recorder.next_index - 1, 0)
            finding = watch.take(index)
            if finding is not None:
                watch.mark_reported()
                self.live.raise_findings([finding])
        except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
            watch.word.value = 0
            watch.mark_reported()
            self.probes.failed("checks", exc)
        self.own_ns += _perf_ns() - t

    def _nonfinite_poll(self, index: int) -> None:
        """CUDA route, a synchronizing forward: the device flags' copy read once it has passed,
        a new copy started at the sampled steps (never a wait on the device)."""
        watch: Any = self.nonfinite
        try:
            finding = watch.poll(index, is_sampled(index, self.check_every))
            if finding is not None:
                watch.mark_reported()
                self.live.raise_findings([finding])
        except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
            watch.mark_reported()
            self.probes.failed("checks", exc)

    def drain_native(self) -> None:
        """The stamps taken in C++ and not drained yet (a backward's, an optimizer step's) go
        into the open step."""
        native = self.native
        if native is not None and native.pending:  # (never while delegated: delegate drains)
            native.drain(self.recorder.current)
        if self.opt_stamps is not None:
            self.take_optimizer()

    def buckets_in_flight(self) -> list[tuple[int, int, int, int, int]]:
        """Native route: the current backward's bucket stamps not yet drained into the step
        (bucket index, ready, launch, done, bytes; done 0 when not seen); empty otherwise."""
        native = self.native  # (read once: another thread may detach meanwhile)
        return native.in_flight() if native is not None else []

    def backward_ended_in_flight(self) -> bool:
        """Native route: the current backward's compute end is stamped (in C++) but not yet
        drained into the step: the rank waits for its all-reduces."""
        native = self.native
        return native.backward_ended() if native is not None else False

    # -- optimizer -----------------------------------------------------------------------

    def optimizer_stamps(self) -> Any:
        """The C++ optimizer hooks' stamps for these hooks (``OptimizerHooks`` registers their
        ``pre`` and ``post``), or None: the Python hooks call ``on_optimizer``. C++ wherever the
        extension loads and the marks are host ones (a CUDA model's are CUDA events)."""
        if self.opt_stamps is None and self.recorder.clock.always_ready:
            extension = native_hook.choose(cuda=self.cuda)
            if extension is not None and hasattr(extension, "OptimizerStamps"):
                self.opt_stamps = extension.OptimizerStamps()
                self._opt_take_into = self.opt_stamps.take_into
        return self.opt_stamps

    def on_optimizer(self, start: bool) -> None:
        """An optimizer step starts or ends (the Python hooks only: with the C++ stamps, they are
        taken after the ring is drained at the next forward)."""
        if self.closed or not self.probes.on["optimizer"]:
            return
        try:
            if start:
                self.recorder.optimizer_start()
            else:
                self.recorder.optimizer_end()
        except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
            self.probes.failed("optimizer", exc)

    def take_optimizer(self) -> None:
        """The optimizer steps stamped in C++ since the last take, in the step they belong to:
        the rule of ``on_optimizer``, applied to their instants."""
        stamps = self.opt_stamps
        if stamps is None:
            return
        try:
            if not self.probes.on["optimizer"]:
                stamps.take(clocks.OFFSET_NS)  # (dropped)
                return
            # a start, then its end, after the step's first bucket are set in C++ (None back): the rule
            # of apply_optimizer_events, for the common case; the rest comes back as the events
            events = self._opt_take_into(self.recorder.current, clocks.OFFSET_NS)
            if events is not None:
                self.apply_optimizer_events(events)
        except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
            self.probes.failed("optimizer", exc)

    def apply_optimizer_events(self, events: list[tuple[bool, int]]) -> None:
        """Optimizer starts and ends stamped elsewhere (host ns), oldest first, in the open step."""
        recorder = self.recorder
        for start, at in events:
            if start:
                recorder.optimizer_start(at)
            else:
                recorder.optimizer_end(at)

    def optimizer_running(self) -> bool:
        """Whether an optimizer step stamped in C++ started and has not ended (any thread; read
        only): the hang watchdog's "optimizer" phase before the stamps are taken."""
        stamps = self.opt_stamps
        return stamps is not None and bool(stamps.running())
