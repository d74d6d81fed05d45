"""Never break training: every probe runs guarded, and a failing probe is switched off."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable

from ddpdoctor.categories import ProbeDisabledWarning, warn


class Probes:
    """On/off switches for a monitor's probes.

    Hot-path code tests ``probes.on[name]`` and wraps its work in ``try``; on an exception it
    calls ``failed(name, exc)``, which switches the probe off, warns once and tells the log.
    """

    NAMES = (
        "forward",
        "buffers",
        "buckets",
        "backward_end",
        "optimizer",
        "layout",
        "emit",
        "proc",
        "checks",
        "live",
        "watchdog",
    )

    def __init__(self, report: Callable[[str, str], None]) -> None:
        self.on: dict[str, bool] = dict.fromkeys(self.NAMES, True)
        #: every probe on (one read for the monitor's routine forward): probes go off through
        #: ``switch_off`` (and ``failed``), which keep it right, never by a write to ``on``
        self.all_on = True
        self._report = report
        self._lock = threading.Lock()

    def switch_off(self, name: str) -> None:
        """Turn a probe off for good, without a warning (the caller says why)."""
        self.all_on = False
        self.on[name] = False

    def failed(self, name: str, exc: BaseException) -> None:
        with self._lock:
            if not self.on.get(name, True):
                return
            self.switch_off(name)
        where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        at = f" at {where[0].filename}:{where[0].lineno}" if where else ""
        detail = f"{type(exc).__name__}: {exc}{at}"
        warn(
            f"ddpdoctor: the '{name}' probe failed ({detail}) and was switched off; training is not affected",
            ProbeDisabledWarning,
            stacklevel=2,
        )
        try:
            self._report(name, detail)
        except Exception:  # noqa: BLE001, S110 - the log itself may be what failed; already warned above
            pass
