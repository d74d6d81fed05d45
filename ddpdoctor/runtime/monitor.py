"""``instrument()`` and the Monitor it returns: one DDP model on one rank, from attach to close.

The Monitor owns the sink and the hot-path callbacks (forward, buffer broadcast, bucket ready,
backward end, optimizer). The DDP surgery is ``attach.Attachment`` (one transaction, with
``detach``), the checks beside the timings are ``sampled_checks.SampledChecks``, and what the
process shares (exit flush, optimizer hooks, sampler and watchdog threads) is
``services.Services``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ddpdoctor.categories import CommHookWarning, LogWriteWarning, ProbeDisabledWarning, warn
from ddpdoctor.events import End, Fingerprint, Header, ProbeOff, ProcSample, Record, Step, Unused, environment
from ddpdoctor.events.schedule import is_sampled
from ddpdoctor.runtime import run_dir, torch_compat
from ddpdoctor.runtime.process import watchdog
from ddpdoctor.runtime.step import clocks, native_hook
from ddpdoctor.runtime.attach import AttachError, Attachment, monitor_of
from ddpdoctor.runtime.step.clocks import CudaClock, HostClock, mono_ns, wall_ns
from ddpdoctor.runtime.config import CHECK_EVERY, Options
from ddpdoctor.runtime.disabled import DisabledMonitor
from ddpdoctor.runtime.header import build_header
from ddpdoctor.runtime.checks.live_findings import LiveFindings
from ddpdoctor.runtime.checks.nonfinite import NonFiniteWatch
from ddpdoctor.runtime.probes import Probes
from ddpdoctor.runtime.checks.sampled import SampledChecks
from ddpdoctor.runtime.process.services import services
from ddpdoctor.runtime.step.recorder import BATCH_NS, BATCH_STEPS, OpenStep, StepRecorder, unpack_marks
from ddpdoctor.runtime.checks.unsynced import UnsyncedUpdates
from ddpdoctor.sinks import FileSink, NullSink, Sink, SinkError
from ddpdoctor.sinks.file import log_mode
from ddpdoctor.sinks.plain_columns import with_lists
from ddpdoctor.sinks.tcp import ENDPOINT_ENV, stream_tee

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
#: How long a clean close polls the GPU for the last steps' CUDA marks (seconds).
_CLOSE_WAIT_S = 2.0


def _close_released(monitor: Monitor) -> None:
    """The model was freed without ``close``: end its log (run from DDP's finalizer)."""
    try:
        monitor.close()
    except Exception:  # noqa: BLE001, S110 - a finalizer must never raise into the code that dropped the model
        pass


def _nothing() -> None:
    return None


__all__ = ["CHECK_EVERY", "DisabledMonitor", "Monitor", "Options", "instrument", "monitor_of"]


class Monitor:
    """Watches one DDP model on one rank and writes what it sees to a sink.

    Use as a context manager or call ``close()``; it is also closed at interpreter exit and when
    SIGTERM kills the process. ``path`` is this rank's log file (None with a custom or null sink).
    Takes an ``Options`` and/or its fields as keywords (``run_dir_path`` is the old name of
    ``run_dir``). Raises ``AttachError`` when it cannot attach (DDP then is as it was).
    """

    #: the forward after a routine step takes ``on_forward_pre``'s routine branch (False: always
    #: the full path; read by ``_routine_possible``, so set it before the monitor's first forward;
    #: the tests compare the two)
    routine_forward = True

    def __init__(
        self, ddp: torch.nn.parallel.DistributedDataParallel, options: Options | None = None, **overrides: Any
    ) -> None:
        if "run_dir_path" in overrides:
            overrides["run_dir"] = overrides.pop("run_dir_path")
        opts = self.options = Options.of(options, **overrides)
        self.ddp = ddp
        self.closed = False
        self._close_lock = threading.Lock()
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.probes = Probes(self._report_probe_off)
        self.path: Path | None = None
        self.run_dir: Path | None = None
        self.ddp_index = 0
        self.header_written = False  # the process sampler waits for it: a log starts with its header
        # ddpdoctor's own time in its training-thread callbacks (forward hooks, buffer broadcast
        # wrapper less the broadcast, bucket-ready, optimizer): steps, checks and live findings
        self.own_ns = 0
        self.check_every = max(1, int(opts.check_every))
        self.hang_timeout = watchdog.hang_timeout_from_env(opts.hang_timeout)
        device = getattr(ddp, "device", torch.device("cpu"))
        self._cuda = device.type == "cuda" if opts.cuda_timing is None else bool(opts.cuda_timing)
        # (a sink of the user's gets the records' bucket columns as lists: ``sinks.plain_columns``)
        self.sink: Sink = with_lists(opts.sink) if opts.sink is not None else self._open_file_sink(opts.run_dir)
        try:
            # the stream is a copy beside the sink (the local file stays the source of truth)
            endpoint = opts.endpoint
            if endpoint is None and opts.sink is None:
                endpoint = environment.read(ENDPOINT_ENV) or None
            self.endpoint = endpoint
            if self.endpoint:
                self.sink = stream_tee(
                    self.sink,
                    self.endpoint,
                    rank=self.rank,
                    ddp=self.ddp_index,
                    run=self.run_dir.name if self.run_dir else "",
                    attempt=run_dir.elastic_attempt(),
                )
            self.recorder = StepRecorder(
                self.rank, self.ddp_index, self.emit, CudaClock() if self._cuda else HostClock(), self.emit_steps
            )
            self._backward_end_ok = torch_compat.available("backward_end")
            if log_mode(opts.log) == "full" or not self._backward_end_ok:
                # every step's detail asked for, or no callback to mark the sync end with:
                # every bucket's marks at every step
                self.recorder.bucket_marks_every_step = True
            self.live = LiveFindings(self.rank, self.ddp_index, self.emit, self._flush_now)
            self._bwd_queued: OpenStep | None = None
            self._native_timing: Any = None
            self._opt_stamps: Any = None  # the C++ optimizer hooks' (``optimizer_stamps``)
            self._opt_take_into: Any = None  # its ``take_into``, read once (a plain C function)
            torch_compat.skip_in_dynamo()  # a compiled DDP calls the hooks as they are
            svc = services()
            self._services = svc
            self.attachment = self._attach(
                ddp,
                "attach",
                extra=(
                    (
                        "services",
                        lambda: svc.join(self, opts.proc_interval, self.hang_timeout),
                        lambda: svc.leave(self),
                    ),
                ),
            )
        except BaseException:
            self._abandon_sink()
            raise

    @property
    def ddp(self) -> Any:
        """The DDP model watched (None after close, or once the script let it go).

        Held weakly: the model holds the monitor (its hooks), not the other way round, so a
        model the script drops is freed by reference counting, as a plain DDP is, and a monitor
        the script keeps after ``close`` keeps no model alive.
        """
        return self._ddp()

    @ddp.setter
    def ddp(self, ddp: Any) -> None:
        self._ddp = weakref.ref(ddp) if ddp is not None else _nothing

    # -- attach / detach ---------------------------------------------------------------

    def _attach(self, ddp: Any, reason: str, extra: tuple[Any, ...] = ()) -> Attachment:
        """Attach to ``ddp`` as one transaction, then write its header and start its checks."""
        first = self.recorder.next_index

        def header(ddp: Any) -> Header:
            return build_header(
                ddp,
                self.rank,
                self.ddp_index,
                self.run_dir.name if self.run_dir else "",
                self.recorder.clock.name,
                reason=reason,
                first_step=first,
            )

        attachment = Attachment.open(ddp, self, header, extra=extra)
        assert attachment.header is not None
        self.ddp = ddp
        self.attachment = attachment
        #: the native hook's per-step side, run from this monitor's hooks (None: Python route);
        #: registered once the attach succeeded (a reducer that refused it leaves None here)
        self._native_timing = attachment.native
        self._close_when_released(ddp)
        self._param_names = {id(p): n for n, p in ddp.module.named_parameters()}
        # each rank's own gradients, looked at before the all-reduce (the native route: in the
        # scaling pass, one word read a forward; the Python route: in its comm hook)
        old = getattr(self, "nonfinite", None)
        self.nonfinite = NonFiniteWatch(ddp, self.rank)
        if old is not None and old.reported:
            self.nonfinite.reported = True  # (a rank's first non-finite step is said once per log)
        elif attachment.native is not None and attachment.native.scale is not None:
            self.nonfinite.watch_native(attachment.native.scale)
        self._nf_word = self.nonfinite.word
        self._buffer_bytes = 0
        self._buffer_bytes_age = _BUFFER_BYTES_EVERY
        # The extension serves the checks and the step records on either route wherever it loads
        # (CPU models, unless DDPDOCTOR_NATIVE=0): a user's comm hook registered before
        # instrument makes the Python route time the buckets, and nothing else changes.
        extension = native_hook.choose(cuda=self._cuda)  # (loaded once per process)
        if extension is not None:
            if self.recorder.clock.always_ready:
                self.recorder.build_step = getattr(extension, "build_step", None)  # host marks
            try:  # the log writer's compaction, in C++ from here: the same bytes
                self.sink.accelerate(extension)
            except Exception:  # noqa: BLE001, S110 - the Python compaction goes on; attaching must never break training
                pass
        self.checks = SampledChecks(
            ddp,
            attachment.header,
            self.check_every,
            self.emit,
            self.rank,
            self.ddp_index,
            same_flags=getattr(extension, "same_requires_grad", None),
            param_sample=getattr(extension, "ParamSample", None),
            tensor_values=getattr(extension, "tensor_values", None),
            failed=self.probes.failed,
        )
        if attachment.native is not None:
            self.checks.compiled_possible = attachment.native.compiled_possible
        self.unsynced = UnsyncedUpdates(self.checks.params, self.checks.reduced, self.rank)
        self.checks.exact_scaling = attachment.exact_scaling
        self.emit(attachment.header)
        if not self.header_written:
            self.header_written = True
            self._services.sample_now()
        if attachment.timing_off is not None:
            self.probes.switch_off("buckets")
            warn(f"ddpdoctor: per-bucket timing is off: {attachment.timing_off}", CommHookWarning, stacklevel=5)
        elif attachment.hook_state is not None:
            self.recorder.set_comm_hook(attachment.hook_state.user_hook_name)
            if native_hook.views_divided_inexactly(ddp) and not attachment.exact_scaling()[1]:
                warn(
                    f"ddpdoctor: gradient_as_bucket_view=True at a world size of {ddp.process_group.size()}: "
                    "without its native extension ddpdoctor's comm hook multiplies every gradient by 1/world "
                    "size, where DDP divides the gradients kept between steps (zero_grad(set_to_none=False)) in "
                    "place: their last bits can differ. Let the extension load (a C++ compiler, DDPDOCTOR_NATIVE "
                    "not 0), or let zero_grad set the gradients to None.",
                    CommHookWarning,
                    stacklevel=5,
                )
        return attachment

    def _close_when_released(self, ddp: Any) -> None:
        """Close when the script lets ``ddp`` go without closing: its log ends (last step, End
        record, sink thread joined) when training with that model ends, as it did when the model
        lived until exit. The finalizer holds this monitor, never the model; ``close`` detaches it.
        """
        old = getattr(self, "_released", None)
        if old is not None:
            old.detach()  # rewrap: the old instance no longer ends this log
        released = weakref.finalize(ddp, _close_released, self)
        released.atexit = False  # at exit, exit_flush closes (reason "exit")
        self._released = released

    @property
    def hook_state(self) -> Any:
        """The timed comm hook's state (None when per-bucket timing is off)."""
        attachment = getattr(self, "attachment", None)
        return attachment.hook_state if attachment is not None else None

    def _drain_native(self) -> None:
        """The stamps taken in C++ and not drained yet (a backward's, an optimizer step's) go
        into the open step."""
        native = getattr(self, "_native_timing", None)
        if native is not None and native.pending:  # (never while delegated: delegate drains)
            native.drain(self.recorder.current)
        if getattr(self, "_opt_stamps", None) is not None:
            self.take_optimizer()

    def optimizer_stamps(self) -> Any:
        """The C++ optimizer hooks' stamps for this monitor (``OptimizerHooks`` registers their
        ``pre`` and ``post``), or None: the Python hooks call ``on_optimizer``. C++ wherever the
        extension loads and the marks are host ones (a CUDA model's are CUDA events)."""
        if self._opt_stamps is None and self.recorder.clock.always_ready:
            extension = native_hook.choose(cuda=self._cuda)
            if extension is not None and hasattr(extension, "OptimizerStamps"):
                self._opt_stamps = extension.OptimizerStamps()
                self._opt_take_into = self._opt_stamps.take_into
        return self._opt_stamps

    def take_optimizer(self) -> None:
        """The optimizer steps stamped in C++ since the last take, in the step they belong to:
        the rule of ``on_optimizer``, applied to their instants."""
        stamps = self._opt_stamps
        if stamps is None:
            return
        try:
            if not self.probes.on["optimizer"]:
                stamps.take(clocks._OFFSET_NS)  # (dropped)
                return
            # a start, then its end, after the step's first bucket are set in C++ (None back): the rule
            # of apply_optimizer_events, for the common case; the rest comes back as the events
            events = self._opt_take_into(self.recorder.current, clocks._OFFSET_NS)
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
        stamps = self._opt_stamps
        return stamps is not None and bool(stamps.running())

    def _detach(self) -> None:
        self._native_timing = None
        watch = getattr(self, "nonfinite", None)
        if watch is not None:
            watch.stop()
        checks = getattr(self, "checks", None)
        if checks is not None:
            checks.end_sample()
            checks.stop()
            checks.compiled_possible = torch_compat.compiled_autograd_possible
        attachment = getattr(self, "attachment", None)
        if attachment is not None:
            attachment.detach()

    def reattach(self, ddp: Any) -> None:
        """Follow the model into a new DDP instance (``ddpdoctor.rewrap``): same log, steps go on.

        If attaching to the new instance fails, this monitor closes (the new DDP trains as is).
        """
        with self._close_lock:
            if self.closed:
                return
            self._drain_native()
            self.recorder.close()
            self._detach()
            self.recorder.reset_layout()
            try:
                self._attach(ddp, reason="rewrap")
            except AttachError as exc:
                warn(
                    f"ddpdoctor could not follow the model into its new DDP ({exc}); training goes on unmonitored",
                    ProbeDisabledWarning,
                    stacklevel=3,
                )
                self.closed = True
                self.attachment = None  # type: ignore[assignment]
                self._close(f"error: {exc.step}", 5.0, final=False)

    def forked(self) -> None:
        """In a forked child (``services.Services.forked``): this copy goes quiet for good. It is
        closed (no End record: the log is the parent's), every probe is off, and it reads no
        native stamps; it writes nothing, and what the model does in the child is not recorded."""
        self.closed = True
        self._close_lock = threading.Lock()  # (a thread of the parent may have held it at the fork)
        for name in self.probes.NAMES:
            self.probes.switch_off(name)
        self._native_timing = None
        self._opt_stamps = None

    def quiesce(self) -> None:
        """End a sample in progress (its hooks go): before the instance is copied or pickled."""
        checks = getattr(self, "checks", None)
        if checks is not None and not self.closed:
            try:
                checks.end_sample()
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                self.probes.failed("checks", exc)

    def _open_file_sink(self, explicit: str | os.PathLike[str] | None) -> Sink:
        store = None
        if explicit is None and not environment.read(run_dir.RUN_DIR_ENV) and dist.is_initialized():
            try:
                store = torch_compat.default_store()
            except Exception:  # noqa: BLE001 - no store means rank-local naming; attaching must never break training
                store = None
        self.run_dir = run_dir.resolve(explicit, self.rank, store, "0")
        self.path, self.ddp_index = run_dir.rank_file(self.run_dir, self.rank)
        try:
            return FileSink(self.path, mode=self.options.log)
        except SinkError as exc:
            warn(f"ddpdoctor: {exc}; training goes on without a log", LogWriteWarning, stacklevel=4)
            self.path = None
            return NullSink()

    def _abandon_sink(self) -> None:
        """Attach failed: stop the sink's threads; a log file left empty is removed."""
        try:
            self.sink.close(1.0)
        except Exception:  # noqa: BLE001, S110 - a failed attach is already being reported; its cleanup must never break training
            pass
        if self.path is not None:
            try:
                if self.path.stat().st_size == 0:
                    self.path.unlink()
            except OSError:
                pass

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
            recorder = getattr(self, "recorder", None)
            if (
                recorder is not None
                and recorder.closed_waiting
                and (type(record) is not ProcSample or recorder.closed_age_ns(mono_ns()) >= _STALE_NS)
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

    def _flush_now(self) -> None:
        self.sink.flush(timeout=2.0)

    def flush(self, timeout: float = 2.0) -> bool:
        """Make what was emitted so far, closed steps included, durable (any thread; e.g. on
        SIGTERM). Never raises."""
        try:
            recorder = getattr(self, "recorder", None)
            if recorder is not None:
                recorder.emit_closed()
            return self.sink.flush(timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - flush runs on any thread, SIGTERM included: never raises
            self.probes.failed("emit", exc)
            return False

    def _report_probe_off(self, probe: str, detail: str) -> None:
        recorder = getattr(self, "recorder", None)
        if probe == "backward_end" and recorder is not None:
            recorder.bucket_marks_every_step = True  # no sync-end mark any more: mark every bucket
        self.emit(ProbeOff(rank=self.rank, ddp=self.ddp_index, t_wall_ns=wall_ns(), probe=probe, error=detail))

    @property
    def steps(self) -> int:
        """Steps recorded so far (emitted, or closed and about to be)."""
        return self.recorder.steps_closed

    @property
    def own_us(self) -> float:
        """ddpdoctor's own time so far on the training thread, in µs: its forward hooks (steps
        closed and emitted, sampled checks, live findings), the buffer-broadcast wrapper less the
        broadcast, and bucket-ready. The comm library's completion callbacks are not counted."""
        return self.own_ns / 1000.0

    # -- probes (hot path) ---------------------------------------------------------------

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
            self._nonfinite_found(self.recorder.current)
        native = self._native_timing
        if native is not None and native.routine and native.pending:
            recorder = self.recorder
            step = recorder.current
            checks = self.checks
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
                and (native._asked_in > 1 or native.routine_config())
            ):
                t = _perf_ns()
                offset = clocks._OFFSET_NS
                routine = True
                try:
                    index = recorder._next_index
                    # in one C call (set: ``_routine_possible``): the ring's marks into the step, packed
                    # (OpenStep.packed; the bytes list the last layout's where equal), the optimizer's
                    # stamps, the step ended now, and OpenStep(index, now), synchronizing, opened
                    new = native.step_change(step, index, offset, recorder._last_bytes)
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
                        closed = recorder._closed
                        closed.append(step)
                        if (
                            len(closed) >= BATCH_STEPS
                            or now - recorder._emitted_at >= BATCH_NS
                            or not recorder.steps_emitted
                        ):
                            recorder.emit_closed(now)
                        # StepRecorder.forward_start, synchronizing, on a synchronizing step
                        recorder.current = new
                        recorder._next_index = index + 1
                        recorder.in_forward = True
                        recorder.in_sync_forward = True
                        checks.bcast_in_forward = False
                        # NativeTiming.on_sync_forward, nothing changed since the last one
                        native._asked_in -= 1
                        native.pending = True
                except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                    self.probes.failed("forward", exc)
                else:
                    if routine:
                        try:
                            if checks.sample is not None or checks._void or checks.fingerprinter.pending:
                                checks.on_step_start(index, new.t0_mono_ns, True, True)  # a sample to end
                            else:  # SampledChecks.on_step_start with nothing of a sample pending
                                # (set: ``_routine_possible`` holds for a routine forward)
                                if not checks._same_flags(checks.params, checks._flag_bytes):  # type: ignore[misc]
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
        if self._opt_stamps is not None:
            self.take_optimizer()  # then its optimizer step's (after the buckets: the rule reads them)
        on = self.probes.on
        if on["forward"] and torch.is_grad_enabled():
            sync = bool(module.require_backward_grad_sync)
            recorder = self.recorder
            try:
                previous = recorder.current
                step = recorder.forward_start(sync)
                self.checks.bcast_in_forward = False
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                self.probes.failed("forward", exc)
            else:
                if sync and self._cuda and not self.nonfinite.reported:
                    self._nonfinite_poll(step.index)
                if sync and native is not None:
                    native.on_sync_forward(step, self)  # (the native route's side of it)
                    if native.routine and not self._routine_possible():
                        native.routine = False
                if on["checks"]:
                    try:
                        # weights changed after a backward inside no_sync (read around no_sync forwards only)
                        unsynced = self.unsynced
                        if not sync or unsynced._noted is not None:
                            ever = recorder.steps_closed > 0 or bool(step.ready)
                            found = unsynced.on_forward(sync, step.index, ever)
                            if found is not None:
                                self.live.raise_findings([found])
                        self.checks.on_step_start(step.index, step.t0_mono_ns, sync, step is not previous)
                    except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                        self.probes.failed("checks", exc)
        self.own_ns += _perf_ns() - t
        if self.live.error is not None:
            self._raise_live_error()

    def _nonfinite_found(self, step: OpenStep | None) -> None:
        """The word says a bucket was not finite: this rank's first non-finite step (the step
        whose backward found it: the one open) is raised, and nothing more is looked at."""
        t = _perf_ns()
        try:
            watch = self.nonfinite
            index = step.index if step is not None else max(self.recorder.next_index - 1, 0)
            finding = watch.take(index)
            if finding is not None:
                watch.mark_reported()
                self.live.raise_findings([finding])
        except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
            self.nonfinite.word.value = 0
            self.nonfinite.mark_reported()
            self.probes.failed("checks", exc)
        self.own_ns += _perf_ns() - t

    def _nonfinite_poll(self, index: int) -> None:
        """CUDA route, a synchronizing forward: the device flags' copy read once it has passed,
        a new copy started at the sampled steps (never a wait on the device)."""
        try:
            finding = self.nonfinite.poll(index, is_sampled(index, self.check_every))
            if finding is not None:
                self.nonfinite.mark_reported()
                self.live.raise_findings([finding])
        except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
            self.nonfinite.mark_reported()
            self.probes.failed("checks", exc)

    def _routine_possible(self) -> bool:
        """What the routine forward (``on_forward_pre``) needs besides the native side's, and
        that never goes away once it holds: the optimizer stamped in C++, the requires_grad
        check in one call (a rewrap's checks get it from the same extension), the change of step
        in one C call (``NativeTiming.step_change``: it opens the next step too), the record built
        in C++ (it reads the packed marks of the change), host marks on every bucket (so no step
        waits for its marks: ``StepRecorder._pending`` stays empty)."""
        recorder = self.recorder
        native = self._native_timing
        return (
            self.routine_forward
            and native is not None
            and self._opt_stamps is not None
            and self.checks._same_flags is not None
            and recorder.build_step is not None  # (packed marks: only build_step reads them)
            and native.bind_step_change(self._opt_stamps)
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
            native = self._native_timing
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
        checks = self.__dict__.get("checks")
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

    def buckets_in_flight(self) -> list[tuple[int, int, int, int, int]]:
        """Native route: the current backward's bucket stamps not yet drained into the step
        (bucket index, ready, launch, done, bytes; done 0 when not seen); empty otherwise."""
        native = self._native_timing  # (read once: another thread may detach meanwhile)
        return native.in_flight() if native is not None else []

    def backward_ended_in_flight(self) -> bool:
        """Native route: the current backward's compute end is stamped (in C++) but not yet
        drained into the step: the rank waits for its all-reduces."""
        native = self._native_timing
        return native.backward_ended() if native is not None else False

    def on_optimizer(self, start: bool) -> None:
        # (Python hooks only: a monitor with the native ring has the C++ optimizer stamps, taken
        # after the ring is drained at its next forward)
        if self.closed or not self.probes.on["optimizer"]:
            return
        try:
            if start:
                self.recorder.optimizer_start()
            else:
                self.recorder.optimizer_end()
        except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
            self.probes.failed("optimizer", exc)

    def device_memory(self) -> tuple[int | None, int | None]:
        if not self._cuda:
            return None, None
        device = self.ddp.device
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self, reason: str = "close", timeout: float = 5.0) -> None:
        """Stop monitoring: a final fingerprint (clean ends), detach from DDP, the last step and
        an End record, flush."""
        with self._close_lock:  # a signal may close from another thread: the second caller waits
            if self.closed:
                return
            self.closed = True
            self._close(reason, timeout, final=reason in ("close", "exit"))

    def _close(self, reason: str, timeout: float, final: bool) -> None:
        # every part guarded: whatever fails, the rest still runs and the End record is written
        released = getattr(self, "_released", None)
        if released is not None:
            released.detach()  # the finalizer's reference to this monitor goes
        self._services.leave(self)
        try:
            word = getattr(self, "_nf_word", None)
            if word is not None and word.value:  # the last backward's buckets were not finite
                self._nonfinite_found(self.recorder.current)
        except Exception as exc:  # noqa: BLE001 - closing must never break training
            self.probes.failed("checks", exc)
        try:
            self._drain_native()
            # a clean end waits (a bounded poll) for the GPU to pass the last steps' marks
            self.recorder.close(wait_s=_CLOSE_WAIT_S if final else 0.0)
        except Exception as exc:  # noqa: BLE001 - closing must never break training
            self.probes.failed("emit", exc)
        checks = getattr(self, "checks", None)
        if checks is not None and self.probes.on["checks"]:
            try:
                if final and self.ddp is not None:
                    checks.final(self.recorder.next_index)
                checks.end_sample()
                checks.fingerprinter.poll()
            except Exception as exc:  # noqa: BLE001 - closing must never break training
                self.probes.failed("checks", exc)
        if final and self.probes.on["live"]:
            try:
                self.live.finish()  # a warning held for confirmation: checked over the whole window
            except Exception as exc:  # noqa: BLE001 - closing must never break training
                self.probes.failed("live", exc)
        try:
            self._detach()
        except Exception as exc:  # noqa: BLE001 - closing must never break training
            self.probes.failed("forward", exc)
        self.emit(
            End(
                rank=self.rank,
                ddp=self.ddp_index,
                t_mono_ns=mono_ns(),
                t_wall_ns=wall_ns(),
                steps=self.recorder.steps_emitted,
                reason=reason,
                signal=self._services.exit_flush.stop_signal,
            )
        )
        try:
            self.sink.close(timeout)
        except Exception as exc:  # noqa: BLE001 - closing must never break training
            self.probes.failed("emit", exc)
        # Let the model go: a monitor kept by the user must not keep DDP's reducer (and its process
        # group) alive past destroy_process_group.
        self.ddp = None
        if checks is not None:
            checks.ddp = None

    def __enter__(self) -> Monitor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(reason="close" if exc_type is None else f"error: {exc_type.__name__}")




def instrument(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    run_dir: str | os.PathLike[str] | None = None,
    *,
    options: Options | None = None,
    **overrides: Any,
) -> Monitor:
    """Start monitoring ``ddp_model`` on this rank; call it on every rank.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` instance.
        run_dir: directory shared by all ranks' files (see ``Options.run_dir``).
        options: an ``Options``; ``overrides`` are its fields as keywords (``sink``,
            ``proc_interval``, ``cuda_timing``, ``check_every``, ``hang_timeout``, ``endpoint``;
            documented on ``ddpdoctor.runtime.config.Options``). An unknown keyword raises
            ``TypeError`` before anything is touched.

    Returns:
        A ``Monitor``: a context manager; ``close()`` detaches and flushes. If ddpdoctor cannot
        attach, it warns (naming the step that failed) and returns a monitor that does nothing:
        DDP is left exactly as it was and training is never broken. A model that is already
        instrumented (e.g. by ``ddpdoctor run``) keeps its monitor, which is returned: a model is
        never instrumented twice.
    """
    if run_dir is not None:
        overrides["run_dir"] = run_dir
    opts = Options.of(options, **overrides)  # a mistyped keyword is the caller's error: raise it
    try:
        existing: Monitor | None = monitor_of(ddp_model)
        if existing is not None:
            return existing
        return Monitor(ddp_model, opts)
    except Exception as exc:  # noqa: BLE001 - attaching must never break the user's training
        warn(
            f"ddpdoctor could not attach to the model ({type(exc).__name__}: {exc}); training goes on unmonitored",
            ProbeDisabledWarning,
            stacklevel=2,
        )
        return DisabledMonitor()  # type: ignore[return-value]
