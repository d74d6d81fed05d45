"""Process statistics at a low rate (CPU %, RSS, device memory) on one daemon thread."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import psutil

from ddpdoctor.events import ProcSample
from ddpdoctor.runtime.clocks import mono_ns, wall_ns

if TYPE_CHECKING:
    from ddpdoctor.runtime.monitor import Monitor


class ProcSampler:
    """Samples this process every ``interval`` seconds for every live monitor."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._monitors: weakref.WeakSet[Monitor] = weakref.WeakSet()
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first call only primes the counter
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpdoctor-proc", daemon=True)
        self._thread.start()

    def add(self, monitor: Monitor) -> None:
        self._monitors.add(monitor)
        self._wake.set()  # a first sample at once, so every rank file has one

    def sample(self, monitor: Monitor) -> ProcSample:
        mem = self._process.memory_info()
        dev, dev_max = monitor.device_memory()
        return ProcSample(
            rank=monitor.rank, ddp=monitor.ddp_index, t_mono_ns=mono_ns(), t_wall_ns=wall_ns(),
            cpu_pct=self._process.cpu_percent(None), rss_bytes=mem.rss,
            dev_mem_bytes=dev, dev_max_mem_bytes=dev_max,
        )

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            for monitor in list(self._monitors):
                if monitor.closed or not monitor.probes.on["proc"]:
                    continue
                try:
                    monitor.emit(self.sample(monitor))
                except Exception as exc:
                    monitor.probes.failed("proc", exc)


_sampler: ProcSampler | None = None
_lock = threading.Lock()


def sampler(interval: float) -> ProcSampler:
    """The process-wide sampler (one thread, however many models are monitored)."""
    global _sampler
    with _lock:
        if _sampler is None:
            _sampler = ProcSampler(interval)
        _sampler.interval = min(_sampler.interval, interval)
        return _sampler
