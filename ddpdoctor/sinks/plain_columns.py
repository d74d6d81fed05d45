"""A sink that is not ddpdoctor's gets step records whose bucket columns are lists.

The native extension builds a step record's bucket columns as ``Column``s (``Step.with_lists``),
which ddpdoctor's own sinks and readers take as they are. A sink of the user's (``instrument(...,
sink=...)``) was promised the schema's ``list[float | None]``, and may encode with msgspec or
``json``, or change a column: it gets the lists, made on the way (a copy of the record's columns).
"""

from __future__ import annotations

from collections.abc import Sequence

from ddpdoctor.events import Record, Step
from ddpdoctor.sinks.base import Sink


def _ours(sink: object) -> bool:
    return isinstance(sink, Sink) and type(sink).__module__.partition(".")[0] == "ddpdoctor"


class PlainColumns(Sink):
    """``inner`` (a sink that is not ddpdoctor's), handed step records with list columns."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner

    def emit(self, record: Record) -> None:
        self.inner.emit(record.with_lists() if type(record) is Step else record)

    def emit_many(self, records: Sequence[Record]) -> None:
        plain = [r.with_lists() if type(r) is Step else r for r in records]
        emit_many = getattr(self.inner, "emit_many", None)
        if emit_many is not None:
            emit_many(plain)
        else:  # (an object with ``emit`` alone)
            Sink.emit_many(self.inner, plain)

    def flush(self, timeout: float = 5.0) -> bool:
        return bool(self.inner.flush(timeout=timeout))

    def close(self, timeout: float = 5.0) -> None:
        self.inner.close(timeout=timeout)


def with_lists(sink: Sink) -> Sink:
    """``sink`` itself when it is ddpdoctor's (a ``Sink``: it has ``emit_many``), else wrapped in
    ``PlainColumns``."""
    return sink if _ours(sink) else PlainColumns(sink)
