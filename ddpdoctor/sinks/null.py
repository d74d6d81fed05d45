"""A sink that drops everything and costs nothing."""

from __future__ import annotations

from collections.abc import Sequence

from ddpdoctor.events import Record
from ddpdoctor.sinks.base import Sink


class NullSink(Sink):
    """Drops every record: for monitoring switched off, or a log that could not be opened."""

    def emit(self, record: Record) -> None:
        return None

    def emit_many(self, records: Sequence[Record]) -> None:
        return None
