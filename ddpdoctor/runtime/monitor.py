"""Attaching to a DDP instance: ``instrument()`` and the Monitor it returns."""

from __future__ import annotations

import operator
import os
import threading
import time
import warnings
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ddpdoctor.categories import CommHookWarning, LogWriteWarning, ProbeDisabledWarning
from ddpdoctor.events import End, Fingerprint, GradFlags, ProbeOff, Record, Unused
from ddpdoctor.runtime import (
    comm_hook,
    exit_flush,
    optimizer_hooks,
    proc_stats,
    run_dir,
    watchdog,
)
from ddpdoctor.runtime.clocks import CudaClock, HostClock, mono_ns, wall_ns
from ddpdoctor.runtime.fingerprints import Fingerprinter
from ddpdoctor.runtime.header import build_header
from ddpdoctor.runtime.live_findings import LiveFindings
from ddpdoctor.runtime.probes import Probes
from ddpdoctor.runtime.step_recorder import OpenStep, StepRecorder
from ddpdoctor.sinks import FileSink, NullSink, Sink, SinkError
from ddpdoctor.sinks.tcp import ENDPOINT_ENV, stream_tee

#: How often the buffer byte count is recomputed (buffers are rarely replaced).
_BUFFER_BYTES_EVERY = 100
#: Default interval of the sampled checks (fingerprints, unused parameters), in steps.
CHECK_EVERY = 50
_requires_grad = operator.attrgetter("requires_grad")

#: The monitor attached to each DDP instance (for ddpdoctor.rewrap).
_monitors: weakref.WeakKeyDictionary[Any, Monitor] = weakref.WeakKeyDictionary()


def monitor_of(ddp: Any) -> Monitor | None:
    """The live monitor attached to ``ddp``, if any."""
    monitor = _monitors.get(ddp)
    return monitor if monitor is not None and not monitor.closed else None


class _Sample:
    """A sampled step in progress: which reduced parameters received a gradient."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.seen: dict[int, int] = {}  # parameter index -> monotonic ns its gradient was accumulated
        self.t0_mono_ns = 0
        self.hooked: list[tuple[int, str]] = []
        self.handles: list[Any] = []
        self.post_forward_us: float | None = None


class Monitor:
    """Watches one DDP model on one rank and writes what it sees to a sink.

    Use as a context manager or call ``close()``; it is also closed at interpreter exit and on
    SIGTERM. ``path`` is this rank's log file (None with a custom or null sink).
    """

    def __init__(
        self,
        ddp: torch.nn.parallel.DistributedDataParallel,
        *,
        run_dir_path: str | os.PathLike[str] | None = None,
        sink: Sink | None = None,
        proc_interval: float = 2.0,
        cuda_timing: bool | None = None,
        check_every: int = CHECK_EVERY,
        hang_timeout: float | None = None,
        endpoint: str | None = None,
    ) -> None:
        self.ddp = ddp
        self.closed = False
        self._close_lock = threading.Lock()
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.probes = Probes(self._report_probe_off)
        self.path: Path | None = None
        self.run_dir: Path | None = None
        self.ddp_index = 0
        self.check_every = max(1, int(check_every))
        self.sink: Sink = sink if sink is not None else self._open_file_sink(run_dir_path)
        # the stream is a copy beside the sink (the local file stays the source of truth)
        if endpoint is None and sink is None:
            endpoint = os.environ.get(ENDPOINT_ENV) or None
        self.endpoint = endpoint
        if self.endpoint:
            self.sink = stream_tee(self.sink, self.endpoint, rank=self.rank, ddp=self.ddp_index,
                                   run=self.run_dir.name if self.run_dir else "", attempt=run_dir.elastic_attempt())
        device = getattr(ddp, "device", torch.device("cpu"))
        self._cuda = device.type == "cuda" if cuda_timing is None else bool(cuda_timing)
        self.recorder = StepRecorder(self.rank, self.ddp_index, self.emit, CudaClock() if self._cuda else HostClock())
        self.live = LiveFindings(self.rank, self.ddp_index, self.emit, self._flush_now)
        self.fingerprinter = Fingerprinter(self._deliver_fingerprint)
        self.hook_state: comm_hook.HookState | None = None
        self._handles: list[Any] = []
        self._sample: _Sample | None = None
        self._bcast_in_forward = False
        self._bwd_queued: OpenStep | None = None
        self._attach(ddp, reason="attach")
        optimizer_hooks.watch(self)
        proc_stats.sampler(proc_interval).add(self)
        exit_flush.register(self)
        self.hang_timeout = watchdog.hang_timeout_from_env(hang_timeout)
        watchdog.watch(self, self.hang_timeout)

    def _attach(self, ddp: Any, reason: str) -> None:
        """Hook into ``ddp``: header, comm hook, forward hooks, buffer broadcast timing."""
        self.ddp = ddp
        _monitors[ddp] = self
        named = list(ddp.module.named_parameters())
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._param_names = {id(p): n for n, p in named}
        self._buffer_bytes = 0
        self._buffer_bytes_age = _BUFFER_BYTES_EVERY
        header = build_header(ddp, self.rank, self.ddp_index, self.run_dir.name if self.run_dir else "",
                              self.recorder.clock.name, reason=reason, first_step=self.recorder.next_index)
        self._reduced = [p.reduced for p in header.params]
        self._ignored = [p.ignored for p in header.params]
        self._flags = [p.requires_grad for p in header.params]
        self.emit(header)
        try:
            self.hook_state = comm_hook.attach(ddp, self)
            self.recorder.set_comm_hook(self.hook_state.user_hook_name)
        except comm_hook.HookUnsupported as exc:
            self.probes.on["buckets"] = False
            warnings.warn(f"ddpdoctor: per-bucket timing is off: {exc}", CommHookWarning, stacklevel=4)
        self._handles = [
            ddp.register_forward_pre_hook(self._on_forward_pre, prepend=True),
            ddp.register_forward_hook(self._on_forward_post, always_call=True),
        ]
        self._orig_sync_buffers = ddp._sync_buffers
        ddp.__dict__["_sync_buffers"] = self._on_sync_buffers

    def _detach(self) -> None:
        """Undo ``_attach`` (the comm hook stays registered, DDP allows only one, and passes through)."""
        self._end_sample()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.ddp is not None:
            self.ddp.__dict__.pop("_sync_buffers", None)
            self.ddp.__dict__.pop("_post_forward", None)
            _monitors.pop(self.ddp, None)
        if self.hook_state is not None:
            self.hook_state.detach()
            self.hook_state = None

    def reattach(self, ddp: Any) -> None:
        """Follow the model into a new DDP instance (``ddpdoctor.rewrap``): same log, steps go on."""
        with self._close_lock:
            if self.closed:
                return
            self.recorder.close()
            self._detach()
            self.recorder.reset_layout()
            self._attach(ddp, reason="rewrap")

    def _open_file_sink(self, explicit: str | os.PathLike[str] | None) -> Sink:
        store = None
        if explicit is None and not os.environ.get(run_dir.RUN_DIR_ENV) and dist.is_initialized():
            try:
                store = dist.distributed_c10d._get_default_store()
            except Exception:
                store = None
        self.run_dir = run_dir.resolve(explicit, self.rank, store, "0")
        self.path, self.ddp_index = run_dir.rank_file(self.run_dir, self.rank)
        try:
            return FileSink(self.path)
        except SinkError as exc:
            warnings.warn(f"ddpdoctor: {exc}; training goes on without a log", LogWriteWarning, stacklevel=4)
            self.path = None
            return NullSink()

    # -- records -------------------------------------------------------------------------

    def emit(self, record: Record) -> None:
        """Hand a record to the sink and to the live checks (never raises)."""
        if self.probes.on["emit"]:
            try:
                self.sink.emit(record)
            except Exception as exc:
                self.probes.failed("emit", exc)
        if self.probes.on["live"]:
            try:
                self.live.observe(record)
            except Exception as exc:
                self.probes.failed("live", exc)

    def _flush_now(self) -> None:
        self.sink.flush(timeout=2.0)

    def _report_probe_off(self, probe: str, detail: str) -> None:
        self.emit(ProbeOff(rank=self.rank, ddp=self.ddp_index, t_wall_ns=wall_ns(), probe=probe, error=detail))

    @property
    def steps(self) -> int:
        """Steps recorded so far."""
        return self.recorder.steps_emitted

    # -- probes (hot path) ---------------------------------------------------------------

    def _on_forward_pre(self, module: Any, args: Any) -> None:
        if not self.probes.on["forward"] or not torch.is_grad_enabled():
            return
        sync = bool(self.ddp.require_backward_grad_sync)
        try:
            previous = self.recorder.current
            self.recorder.forward_start(sync)
            step = self.recorder.current
            self._bcast_in_forward = False
        except Exception as exc:
            self.probes.failed("forward", exc)
            return
        if self.probes.on["checks"]:
            try:
                if step is not previous:
                    self._end_sample()
                    self.fingerprinter.poll()
                self._check_grad_flags(step.index)
                if sync and self._sample is None and self._sample_due(step.index):
                    self._begin_sample(step.index, step.t0_mono_ns)
            except Exception as exc:
                self.probes.failed("checks", exc)

    # -- sampled checks --------------------------------------------------------------------

    def _check_grad_flags(self, step: int) -> None:
        """Compare requires_grad with what DDP was built with: every forward, one C-level pass."""
        flags = list(map(_requires_grad, self._params))
        if flags == self._flags:
            return
        self._flags = flags
        frozen = [n for n, r, f in zip(self._names, self._reduced, flags) if r and not f]
        unfrozen = [n for n, r, f, i in zip(self._names, self._reduced, flags, self._ignored) if f and not r and not i]
        self.emit(GradFlags(rank=self.rank, ddp=self.ddp_index, step=step, frozen=frozen, unfrozen=unfrozen))

    def _sample_due(self, step: int) -> bool:
        return step in (0, 1, 3) or step % self.check_every == 0

    def _begin_sample(self, step: int, t0_mono_ns: int) -> None:
        sample = self._sample = _Sample(step)
        sample.t0_mono_ns = t0_mono_ns
        seen = sample.seen
        now = time.monotonic_ns
        for i, (p, reduced) in enumerate(zip(self._params, self._reduced)):
            if reduced and p.requires_grad:
                sample.hooked.append((i, self._names[i]))
                sample.handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: seen.__setitem__(i, now())))
        # after DDP's own pre-forward (buffer broadcast), right before the wrapped module runs
        sample.handles.append(self.ddp.module.register_forward_pre_hook(self._on_module_pre))
        ddp = self.ddp
        original = ddp._post_forward
        clock = HostClock()

        def timed_post_forward(output: Any) -> Any:
            ddp.__dict__.pop("_post_forward", None)
            start = clock.now()
            try:
                return original(output)
            finally:
                sample.post_forward_us = clock.us(start, clock.now())

        ddp.__dict__["_post_forward"] = timed_post_forward

    def _on_module_pre(self, module: Any, args: Any) -> None:
        sample = self._sample
        if sample is None or not self.probes.on["checks"]:
            return
        try:
            handle = sample.handles.pop()  # this hook: once per sample
            handle.remove()
            buffers = [b for _, b in self.ddp.module.named_buffers()]
            meta = (sample.step, len(self._params), [int(b._version) for b in buffers], self._bcast_in_forward)
            self.fingerprinter.take(self._params + buffers, meta)
        except Exception as exc:
            self.probes.failed("checks", exc)

    def _deliver_fingerprint(self, meta: Any, norms: list[float], sums: list[float]) -> None:
        step, n, versions, after_broadcast = meta
        self.emit(Fingerprint(rank=self.rank, ddp=self.ddp_index, step=step, param_norms=norms[:n],
                              param_sums=sums[:n], buffer_norms=norms[n:], buffer_sums=sums[n:],
                              buffer_versions=versions, after_broadcast=after_broadcast))

    def _end_sample(self) -> None:
        sample, self._sample = self._sample, None
        if sample is None:
            return
        for handle in sample.handles:
            handle.remove()
        if self.ddp is not None:
            self.ddp.__dict__.pop("_post_forward", None)
        names = [name for i, name in sample.hooked if i not in sample.seen]
        t0, seen = sample.t0_mono_ns, sample.seen
        ready = [round((seen[i] - t0) / 1000.0, 1) if i in seen else None for i in range(len(self._params))]
        self.emit(Unused(rank=self.rank, ddp=self.ddp_index, step=sample.step, names=names,
                         post_forward_us=sample.post_forward_us, param_ready_us=ready))

    def _on_forward_post(self, module: Any, args: Any, output: Any) -> None:
        if not self.probes.on["forward"]:
            return
        try:
            self.recorder.forward_end()
        except Exception as exc:
            self.probes.failed("forward", exc)

    def _on_sync_buffers(self) -> None:
        if not (self.probes.on["buffers"] and self.recorder.in_forward):
            return self._orig_sync_buffers()
        clock = self.recorder.clock
        try:
            start = clock.now()
        except Exception as exc:
            self.probes.failed("buffers", exc)
            return self._orig_sync_buffers()
        self.recorder.in_broadcast = True
        try:
            self._orig_sync_buffers()
        finally:
            self.recorder.in_broadcast = False
        self._bcast_in_forward = True
        try:
            end = clock.now()
            self._buffer_bytes_age += 1
            if self._buffer_bytes_age >= _BUFFER_BYTES_EVERY:
                self._buffer_bytes = sum(b.numel() * b.element_size() for b in self.ddp.modules_buffers)
                self._buffer_bytes_age = 0
            self.recorder.buffers_broadcast(start, end, self._buffer_bytes)
        except Exception as exc:
            self.probes.failed("buffers", exc)
        return None

    def on_bucket_ready(self, bucket: dist.GradBucket, index: int) -> OpenStep | None:
        """First thing in the comm hook: ready time, bytes, layout sample, backward-end callback."""
        step = self.recorder.bucket_ready(index, bucket)
        if step is None:
            return None
        if step.layout is not None and self.probes.on["layout"]:
            try:
                self.recorder.bucket_layout(step, index, comm_hook.bucket_info(bucket, self._param_names))
            except Exception as exc:
                self.probes.failed("layout", exc)
        if self._bwd_queued is not step and self.probes.on["backward_end"]:
            self._bwd_queued = step
            try:
                # Final callbacks run when the autograd graph is done, before DDP's own
                # finalization waits for the all-reduces: that instant is "backward compute end".
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._on_backward_end(step))
            except Exception as exc:
                self.probes.failed("backward_end", exc)
        return step

    def _on_backward_end(self, step: OpenStep) -> None:
        try:
            self.recorder.backward_end(step)
        except Exception as exc:  # an exception here would surface inside loss.backward()
            self.probes.failed("backward_end", exc)

    def on_optimizer(self, start: bool) -> None:
        if self.closed or not self.probes.on["optimizer"]:
            return
        try:
            if start:
                self.recorder.optimizer_start()
            else:
                self.recorder.optimizer_end()
        except Exception as exc:
            self.probes.failed("optimizer", exc)

    def device_memory(self) -> tuple[int | None, int | None]:
        if not self._cuda:
            return None, None
        device = self.ddp.device
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self, reason: str = "close", timeout: float = 5.0) -> None:
        """Stop monitoring: detach from DDP, emit the last step and an End record, flush."""
        with self._close_lock:  # a signal may close from another thread: the second caller waits
            if self.closed:
                return
            self.closed = True
            self._close(reason, timeout)

    def _close(self, reason: str, timeout: float) -> None:
        watchdog.unwatch(self)
        self._detach()
        optimizer_hooks.unwatch(self)
        try:
            self.recorder.close()
            self.fingerprinter.poll()
        except Exception as exc:
            self.probes.failed("emit", exc)
        self.emit(End(rank=self.rank, ddp=self.ddp_index, t_mono_ns=mono_ns(), t_wall_ns=wall_ns(),
                      steps=self.recorder.steps_emitted, reason=reason))
        try:
            self.sink.close(timeout)
        except Exception as exc:
            self.probes.failed("emit", exc)
        # Let the model go: a monitor kept by the user must not keep DDP's reducer (and its process
        # group) alive past destroy_process_group.
        self.ddp = None  # type: ignore[assignment]
        self._orig_sync_buffers = None  # type: ignore[assignment]

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(reason="close" if exc_type is None else f"error: {exc_type.__name__}")


class _DisabledMonitor:
    """What ``instrument`` returns when it could not attach: same surface, does nothing."""

    closed = True
    steps = 0
    path = None
    run_dir = None

    def close(self, reason: str = "close", timeout: float = 5.0) -> None:
        return None

    def __enter__(self) -> _DisabledMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def instrument(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    run_dir: str | os.PathLike[str] | None = None,
    *,
    sink: Sink | None = None,
    proc_interval: float = 2.0,
    cuda_timing: bool | None = None,
    check_every: int = CHECK_EVERY,
    hang_timeout: float | None = None,
    endpoint: str | None = None,
) -> Monitor:
    """Start monitoring ``ddp_model`` on this rank; call it on every rank.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` instance.
        run_dir: directory shared by all ranks' files. Default: ``$DDPDOCTOR_RUN_DIR``, else a new
            ``ddpdoctor-runs/<time>-<id>`` agreed with rank 0 through the rendezvous store.
        sink: where records go instead of the run dir (``MemorySink`` in tests, ``NullSink``).
        proc_interval: seconds between process statistics samples (CPU %, RSS, device memory).
        cuda_timing: time with CUDA events; default: when the model is on a CUDA device.
        check_every: interval, in steps, of the sampled checks (parameter and buffer fingerprints
            compared across ranks, unused parameters); they also run at steps 0, 1 and 3.
        hang_timeout: seconds without progress before the hang watchdog records where this rank
            is (phase, step, pending bucket, stack) and flushes it. Default:
            ``$DDPDOCTOR_HANG_TIMEOUT``, else 120; 0 turns the watchdog off.
        endpoint: ``HOST:PORT`` of a ``ddpdoctor watch --listen`` or ``ddpdoctor collect`` to stream
            every record to as well (bounded queue, drops counted, never blocks training; the local
            file stays complete). Default: ``$DDPDOCTOR_ENDPOINT`` (when no ``sink`` is given).

    Returns:
        A ``Monitor``: a context manager; ``close()`` detaches and flushes. If ddpdoctor cannot
        attach, it warns and returns a monitor that does nothing: training is never broken.
        A model that is already instrumented (e.g. by ``ddpdoctor run``) keeps its monitor,
        which is returned: a model is never instrumented twice.
    """
    try:
        existing = monitor_of(ddp_model)
        if existing is not None:
            return existing
        return Monitor(ddp_model, run_dir_path=run_dir, sink=sink, proc_interval=proc_interval,
                       cuda_timing=cuda_timing, check_every=check_every, hang_timeout=hang_timeout,
                       endpoint=endpoint)
    except Exception as exc:
        warnings.warn(f"ddpdoctor could not attach to the model ({type(exc).__name__}: {exc}); "
                      "training goes on unmonitored", ProbeDisabledWarning, stacklevel=2)
        return _DisabledMonitor()  # type: ignore[return-value]
