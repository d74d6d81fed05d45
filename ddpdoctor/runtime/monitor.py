"""``instrument()`` and the Monitor it returns: one DDP model on one rank, from attach to close.

The Monitor keeps the options, the sink, the attach and detach (with the header each writes) and
the close. What runs at every step is elsewhere: the probes torch calls are
``step.hooks.StepHooks``, which the Monitor makes with its sink; the DDP surgery is
``attach.Attachment`` (one transaction, with ``detach``); the checks beside the timings are
``checks.sampled.SampledChecks``; what the process shares (exit flush, optimizer hooks, sampler
and watchdog threads) is ``process.services.Services``.
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ddpdoctor.categories import CommHookWarning, ProbeDisabledWarning, warn
from ddpdoctor.events import End, Header, ProbeOff, Record, environment
from ddpdoctor.runtime import run_dir, torch_compat
from ddpdoctor.runtime.attach import AttachError, Attachment, monitor_of
from ddpdoctor.runtime.checks.attached import start_checks, stop_checks
from ddpdoctor.runtime.checks.live_findings import LiveFindings
from ddpdoctor.runtime.config import CHECK_EVERY, Options
from ddpdoctor.runtime.disabled import DisabledMonitor
from ddpdoctor.runtime.header import build_header
from ddpdoctor.runtime.probes import Probes
from ddpdoctor.runtime.process import watchdog
from ddpdoctor.runtime.process.services import services
from ddpdoctor.runtime.step import native_hook
from ddpdoctor.runtime.step.clocks import CudaClock, HostClock, mono_ns, wall_ns
from ddpdoctor.runtime.step.hooks import StepHooks
from ddpdoctor.sinks import Sink
from ddpdoctor.sinks.file import log_mode
from ddpdoctor.sinks.plain_columns import with_lists
from ddpdoctor.sinks.tcp import ENDPOINT_ENV, stream_tee

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
        self.check_every = max(1, int(opts.check_every))
        self.hang_timeout = watchdog.hang_timeout_from_env(opts.hang_timeout)
        device = getattr(ddp, "device", torch.device("cpu"))
        #: the marks are CUDA events (a CUDA model, unless ``Options.cuda_timing`` says otherwise)
        self.cuda = device.type == "cuda" if opts.cuda_timing is None else bool(opts.cuda_timing)
        if opts.sink is not None:  # (a sink of the user's gets the bucket columns as lists)
            self.sink: Sink = with_lists(opts.sink)
        else:
            self.sink, self.run_dir, self.path, self.ddp_index = run_dir.open_file_sink(
                opts.run_dir, self.rank, opts.log
            )
        try:
            # the stream is a copy beside the sink (the local file stays the source of truth)
            self.endpoint = opts.endpoint
            if self.endpoint is None and opts.sink is None:
                self.endpoint = environment.read(ENDPOINT_ENV) or None
            if self.endpoint:
                run, attempt = self.run_dir.name if self.run_dir else "", run_dir.elastic_attempt()
                self.sink = stream_tee(
                    self.sink, self.endpoint, rank=self.rank, ddp=self.ddp_index, run=run, attempt=attempt
                )
            #: the probes torch calls at every step (and the records' way to the sink)
            self.hooks = hooks = StepHooks(
                self.rank,
                self.ddp_index,
                self.sink,
                self.probes,
                CudaClock() if self.cuda else HostClock(),
                self.cuda,
                self.check_every,
                every_bucket=log_mode(opts.log) == "full",
            )
            self.recorder = hooks.recorder
            self.live = hooks.live = LiveFindings(self.rank, self.ddp_index, hooks.emit, self._flush_now)
            torch_compat.skip_in_dynamo()  # a compiled DDP calls the hooks as they are
            self._services = svc = services()
            join = ("services", lambda: svc.join(self, opts.proc_interval, self.hang_timeout), lambda: svc.leave(self))
            self.attachment = self._attach(ddp, "attach", extra=(join,))
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
        self._close_when_released(ddp)
        # The extension serves the checks and the step records on either route wherever it loads
        # (CPU models, unless DDPDOCTOR_NATIVE=0): a user's comm hook registered before
        # instrument makes the Python route time the buckets, and nothing else changes.
        extension = native_hook.choose(cuda=self.cuda)  # (loaded once per process)
        if extension is not None:
            if self.recorder.clock.always_ready:
                self.recorder.build_step = getattr(extension, "build_step", None)  # host marks
            try:  # the log writer's compaction, in C++ from here: the same bytes
                self.sink.accelerate(extension)
            except Exception:  # noqa: BLE001, S110 - the Python compaction goes on; attaching must never break training
                pass
        old = getattr(self, "nonfinite", None)
        self.checks, self.nonfinite, self.unsynced = start_checks(
            ddp,
            attachment,
            extension,
            self.rank,
            self.ddp_index,
            self.check_every,
            self.hooks.emit,
            self.probes.failed,
            reported=old is not None and old.reported,
        )
        # the native side (None: the Python route) is the one registered once the attach
        # succeeded: a reducer that refused it leaves None
        param_names = {id(p): n for n, p in ddp.module.named_parameters()}
        self.hooks.attached(self.checks, self.nonfinite, self.unsynced, attachment.native, param_names)
        self.emit(attachment.header)
        if not self.header_written:
            self.header_written = True
            self._services.sample_now()
        if attachment.timing_off is not None:
            self.probes.switch_off("buckets")
            warn(f"ddpdoctor: per-bucket timing is off: {attachment.timing_off}", CommHookWarning, stacklevel=5)
        elif attachment.hook_state is not None:
            self.recorder.set_comm_hook(attachment.hook_state.user_hook_name)
            attachment.warn_inexact_views(stacklevel=5)
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

    def _detach(self) -> None:
        self.hooks.native = None
        stop_checks(getattr(self, "checks", None), getattr(self, "nonfinite", None))
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
            self.hooks.drain_native()
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
                self.closed = self.hooks.closed = True
                self.attachment = None  # type: ignore[assignment]
                self._close(f"error: {exc.step}", 5.0, final=False)

    def forked(self) -> None:
        """In a forked child (``services.Services.forked``): this copy goes quiet for good. It is
        closed (no End record: the log is the parent's), every probe is off, and it reads no
        native stamps; it writes nothing, and what the model does in the child is not recorded."""
        self.closed = True
        self._close_lock = threading.Lock()  # (a thread of the parent may have held it at the fork)
        self.hooks.quiet()

    def quiesce(self) -> None:
        """End a sample in progress (its hooks go): before the instance is copied or pickled."""
        checks = getattr(self, "checks", None)
        if checks is not None and not self.closed:
            try:
                checks.end_sample()
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                self.probes.failed("checks", exc)

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

    def emit(self, record: Record) -> None:
        """Hand a record to the sink and to the live checks, the closed steps first where the log
        needs them first (``StepHooks.emit``; never raises)."""
        self.hooks.emit(record)

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
        return self.hooks.own_ns / 1000.0

    @property
    def own_ns(self) -> int:
        """``own_us`` in ns (``StepHooks.own_ns``)."""
        return self.hooks.own_ns

    def device_memory(self) -> tuple[int | None, int | None]:
        """This model's device memory now and at its peak (bytes; None, None off CUDA)."""
        if not self.cuda:
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
            self.closed = self.hooks.closed = True
            self._close(reason, timeout, final=reason in ("close", "exit"))

    def _close(self, reason: str, timeout: float, final: bool) -> None:
        # every part guarded: whatever fails, the rest still runs and the End record is written
        released = getattr(self, "_released", None)
        if released is not None:
            released.detach()  # the finalizer's reference to this monitor goes
        self._services.leave(self)
        try:
            watch = getattr(self, "nonfinite", None)
            if watch is not None and watch.word.value:  # the last backward's buckets were not finite
                self.hooks.nonfinite_found(self.recorder.current)
        except Exception as exc:  # noqa: BLE001 - closing must never break training
            self.probes.failed("checks", exc)
        try:
            self.hooks.drain_native()
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
