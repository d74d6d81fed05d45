"""Process statistics at a low rate (CPU %, RSS, device memory) on one daemon thread."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import psutil

from ddpdoctor.events import ProcSample
from ddpdoctor.runtime.step.clocks import mono_ns, wall_ns

if TYPE_CHECKING:
    from ddpdoctor.runtime.protocols import ProcSource


class ProcSampler:
    """Samples this process every ``interval`` seconds for every live monitor."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._sources: weakref.WeakSet[ProcSource] = weakref.WeakSet()
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first call only primes the counter
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ddpdoctor-proc", daemon=True)
        self._thread.start()

    def add(self, source: ProcSource) -> None:
        self._sources.add(source)
        self._wake.set()  # a first sample at once, so every rank file has one

    def wake(self) -> None:
        """Sample now (a source's header was just written: its first sample follows it)."""
        self._wake.set()

    def remove(self, source: ProcSource) -> None:
        self._sources.discard(source)

    def sample(self, source: ProcSource) -> ProcSample:
        mem = self._process.memory_info()
        dev, dev_max = source.device_memory()
        return ProcSample(
            rank=source.rank,
            ddp=source.ddp_index,
            t_mono_ns=mono_ns(),
            t_wall_ns=wall_ns(),
            cpu_pct=self._process.cpu_percent(None),
            rss_bytes=mem.rss,
            dev_mem_bytes=dev,
            dev_max_mem_bytes=dev_max,
        )

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread (``Services.shutdown``)."""
        self._stop = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop:
                return
            self._round()

    def _round(self) -> None:
        # its own frame: no monitor stays referenced from this thread while it sleeps (a closed
        # monitor, and through it a DDP model, must be freed when the script lets it go)
        for source in list(self._sources):
            if source.closed or not source.probes.on["proc"] or not getattr(source, "header_written", True):
                continue  # a log starts with its header: no sample before it
            try:
                source.emit(self.sample(source))
            except Exception as exc:  # noqa: BLE001 - a failing probe is reported and switched off; it must never break training
                source.probes.failed("proc", exc)
