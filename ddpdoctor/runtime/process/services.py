"""The process-wide services every monitor joins, in one object with an explicit shutdown.

One process may monitor several DDP models; these exist once per process however many:

- ``exit_flush``: closes the logs at exit, flushes them on SIGTERM (signals untouched otherwise);
- ``optimizer_hooks``: torch's global optimizer step hooks (removed when no monitor is left);
- the process sampler thread (CPU %, RSS, device memory), started with the first monitor;
- the hang watchdog thread, started with the first monitor that has a ``hang_timeout``.

Both threads stop when the last monitor leaves: a process that stops monitoring keeps no thread.

``services()`` returns the process's instance; ``Services.shutdown()`` closes every monitor and
stops everything it started (a fresh instance is made on the next use).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from ddpdoctor.runtime.process.exit_flush import ExitFlush
from ddpdoctor.runtime.process.proc_stats import ProcSampler
from ddpdoctor.runtime.process.watchdog import Watchdog
from ddpdoctor.runtime.step.optimizer_hooks import OptimizerHooks


class Services:
    """The process-wide services (see the module docstring)."""

    def __init__(self) -> None:
        self.exit_flush = ExitFlush()
        self.optimizer_hooks = OptimizerHooks()
        self._sampler: ProcSampler | None = None
        self._watchdog: Watchdog | None = None
        self._lock = threading.Lock()
        self._members: weakref.WeakSet[Any] = weakref.WeakSet()

    def join(self, monitor: Any, proc_interval: float, hang_timeout: float) -> None:
        """Everything ``monitor`` gets from the process: optimizer timing, samples, exit, watchdog
        (the optimizer hooks and the watchdog call its ``hooks``, the step's side)."""
        self.optimizer_hooks.watch(monitor.hooks)
        with self._lock:
            self._members.add(monitor)
            if self._sampler is None:
                self._sampler = ProcSampler(proc_interval)
            self._sampler.interval = min(self._sampler.interval, proc_interval)
            sampler = self._sampler
            if hang_timeout > 0 and self._watchdog is None:
                self._watchdog = Watchdog()
            dog = self._watchdog if hang_timeout > 0 else None
        sampler.add(monitor)
        self.exit_flush.register(monitor)
        if dog is not None:
            dog.add(monitor.hooks, hang_timeout)

    def sample_now(self) -> None:
        """A process sample for every member at once (a header was just written)."""
        sampler = self._sampler
        if sampler is not None:
            sampler.wake()

    def leave(self, monitor: Any) -> None:
        """``monitor`` closes: nothing of the process refers to it any more."""
        if self._watchdog is not None:
            self._watchdog.remove(monitor.hooks)
        if self._sampler is not None:
            self._sampler.remove(monitor)
        self.optimizer_hooks.unwatch(monitor.hooks)
        self.exit_flush.unregister(monitor)
        with self._lock:
            self._members.discard(monitor)
            if len(self._members):
                return
            sampler, dog = self._sampler, self._watchdog
            self._sampler = self._watchdog = None
        for service in (sampler, dog):
            if service is not None:
                service.stop(timeout=0.5)

    @property
    def threads(self) -> list[threading.Thread]:
        """The threads these services run (for tests: none left after ``shutdown``)."""
        out = [s._thread for s in (self._sampler, self._watchdog) if s is not None]
        return [t for t in out if t.is_alive()]

    def forked(self) -> None:
        """In a forked child: every monitor copied into it goes quiet (``Monitor.forked``), and
        the child keeps none of the parent's exit and signal set-up (``ExitFlush.forked``). Its
        threads were not copied; nothing of them is joined."""
        for monitor in list(self._members):
            try:
                monitor.forked()
            except Exception:  # noqa: BLE001, S110 - in a child being born: never raise into it
                pass
        self.exit_flush.forked()

    def shutdown(self) -> None:
        """Close every monitor, remove the optimizer hooks and signal handler, stop the threads."""
        self.exit_flush.close_all("close")
        self.exit_flush.shutdown()
        self.optimizer_hooks.shutdown()
        with self._lock:
            sampler, dog = self._sampler, self._watchdog
            self._sampler = self._watchdog = None
        for service in (sampler, dog):
            if service is not None:
                service.stop()


_services: Services | None = None
_lock = threading.Lock()


def services() -> Services:
    """This process's services (made on first use)."""
    global _services
    with _lock:
        if _services is None:
            _services = Services()
        return _services


def _after_fork_in_child() -> None:
    """A forked child is not the process its parent's monitors watch: it drops this process's
    services (their threads did not survive the fork) and a monitor made in it starts fresh ones."""
    global _services, _lock
    _lock = threading.Lock()  # (a thread of the parent may have held it at the fork)
    current, _services = _services, None
    if current is not None:
        current.forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def shutdown() -> None:
    """Shut this process's services down; the next monitor starts fresh ones."""
    global _services
    with _lock:
        current, _services = _services, None
    if current is not None:
        current.shutdown()
