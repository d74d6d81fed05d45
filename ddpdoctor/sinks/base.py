"""The sink boundary: one method to hand a record over, never blocking training."""

from __future__ import annotations

from collections.abc import Sequence

from ddpdoctor.errors import OutputError
from ddpdoctor.events import Record


class SinkError(OutputError, OSError):
    """A sink could not be opened (e.g. the run dir is not writable)."""


class Sink:
    """Where a rank's records go.

    ``emit`` is the whole contract on the hot path: it must return at once and never raise for
    I/O reasons. ``flush`` and ``close`` are for the end of a run and for emergencies (a signal,
    a hang); both take a timeout so that a stuck disk cannot stall the process.
    """

    def emit(self, record: Record) -> None:
        raise NotImplementedError

    def emit_many(self, records: Sequence[Record]) -> None:
        """``emit`` each of ``records`` in turn (a sink may take them in one go)."""
        for record in records:
            self.emit(record)

    def flush(self, timeout: float = 5.0) -> bool:
        """Make everything emitted so far durable; True if it was done within ``timeout``."""
        return True

    def accelerate(self, extension: object) -> None:
        """The runtime's native extension has loaded: a sink may do its work with it from now on
        (the file sink's compaction does), with the same results. Nothing, by default."""

    def close(self, timeout: float = 5.0) -> None:
        """Flush and release; later ``emit`` calls are dropped."""
