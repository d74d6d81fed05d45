"""An in-memory sink, for tests and notebooks."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ddpdoctor.events import Record
from ddpdoctor.sinks.base import Sink


class MemorySink(Sink):
    """Keeps every record in ``records`` (thread-safe append)."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.closed = False
        self._lock = threading.Lock()

    def emit(self, record: Record) -> None:
        with self._lock:
            if not self.closed:
                self.records.append(record)

    def emit_many(self, records: Sequence[Record]) -> None:
        with self._lock:
            if not self.closed:
                self.records.extend(records)

    def close(self, timeout: float = 5.0) -> None:
        self.closed = True

    def of_kind(self, kind: type) -> list[Record]:
        """The records of one type, in emission order."""
        with self._lock:
            return [r for r in self.records if isinstance(r, kind)]
