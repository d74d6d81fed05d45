"""``DisabledMonitor``: what ``instrument`` returns where it could not attach, and what a copy of a
monitored model carries (``attach``): the Monitor's surface, doing nothing."""

from __future__ import annotations


class DisabledMonitor:
    """What ``instrument`` returns when it could not attach: same surface, does nothing."""

    closed = True
    steps = 0
    path = None
    run_dir = None

    def close(self, reason: str = "close", timeout: float = 5.0) -> None:
        return None

    def flush(self, timeout: float = 2.0) -> bool:
        return True

    def __enter__(self) -> DisabledMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
