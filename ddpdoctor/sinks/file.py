"""The per-rank append-only log file, written by a background thread."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ddpdoctor.categories import LogWriteWarning, warn
from ddpdoctor.events import Record, encode_into, environment
from ddpdoctor.events.layout import LOG_MODE_ENV
from ddpdoctor.events.line_index import LineIndexer
from ddpdoctor.events.schedule import DEFAULT_EVERY
from ddpdoctor.sinks.background import BackgroundSink
from ddpdoctor.sinks.base import SinkError
from ddpdoctor.sinks.compact import Compactor

#: Upper bound on how long an emitted record may sit in memory before it reaches the OS.
FLUSH_INTERVAL_S = 0.2
#: Records kept in memory when the disk cannot keep up; beyond this they are dropped and counted.
MAX_PENDING = 100_000
#: What the file keeps: see ``sinks.compact`` ("compact") or every step in full ("full").
LOG_MODES = ("compact", "full")


def log_mode(mode: str | None = None) -> str:
    """The log mode asked for: ``mode``, else ``$DDPDOCTOR_LOG``, else "compact" (an unknown value too)."""
    value = (mode or environment.read(LOG_MODE_ENV)).strip().lower()
    return value if value in LOG_MODES else "compact"


class FileSink(BackgroundSink):
    """Appends JSON lines to ``path`` from a daemon thread.

    The training thread only appends records to a deque. The writer wakes every
    ``FLUSH_INTERVAL_S`` (or at once for ``flush``/``close``), encodes everything pending in one
    batch, writes and flushes: a crash or SIGKILL loses at most that interval. Waking on a timer
    rather than per record matters on small machines, where every wake-up of another thread
    costs the training threads a GIL hand-off. The file is opened (and the directory created) in
    the constructor so that an unwritable run dir is reported at once as ``SinkError``.

    ``mode`` "compact" (the default, or ``$DDPDOCTOR_LOG``) writes full step records only at
    sampled steps (every ``every``-th, dense at the start) and around anything anomalous, and
    windows of per-step columns otherwise (``sinks.compact``); "full" writes every record as it
    came. Compaction happens here, on the writer thread.

    The file indexes its own lines (``sinks.line_index``): a reader of a long log seeks to the
    lines it needs instead of scanning them all. A file that ends in a torn line (a crashed
    process of the same rank) gets a newline first, so that the torn line stays one corrupt line
    and the first new one stays whole.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        flush_interval: float = FLUSH_INTERVAL_S,
        mode: str | None = None,
        every: int = DEFAULT_EVERY,
    ) -> None:
        self.path = Path(path)
        self.flush_interval = flush_interval
        self.write_errors = 0
        self.mode = log_mode(mode)
        self.compactor: Compactor | None = Compactor(every) if self.mode == "compact" else None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab", buffering=1 << 16)  # noqa: SIM115 - owned by the writer
        except OSError as exc:
            raise SinkError(f"cannot open {self.path} for writing: {exc.strerror or exc}") from exc
        try:
            self._index: LineIndexer | None = LineIndexer(self.path, os.fstat(self._file.fileno()).st_size)
        except OSError:  # (unreadable tail: a reader scans this file as it did before the index)
            self._index = None
        self._init_queue(MAX_PENDING)
        self._warned = False
        self._thread = threading.Thread(target=self._run, name=f"ddpdoctor-writer:{self.path.name}", daemon=True)
        self._thread.start()

    def accelerate(self, extension: object) -> None:
        compactor = self.compactor
        if compactor is not None:
            compactor.accelerate(extension)

    # -- writer thread -------------------------------------------------------------------------

    def _run(self) -> None:
        buf = bytearray()
        while True:
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            requests = self._take_requests()
            index = self._index
            for record in self._take_records(bool(requests)):
                mark = len(buf)
                try:
                    encode_into(record, buf)
                except Exception as exc:  # noqa: BLE001 - a record that cannot be encoded is a bug: lose it, not the log
                    del buf[mark:]
                    self._report(f"could not encode a {type(record).__name__} record: {exc}")
                    continue
                if index is not None:
                    index.note_record(buf, mark, record)
            stop = any(r.stop for r in requests)
            self._write(buf, final=stop)
            buf.clear()
            for request in requests:
                request.done.set()
            if stop:
                break
        try:
            self._file.close()
        except OSError as exc:
            self._report(str(exc))

    def _take_records(self, drain: bool) -> list[Record]:
        """What to write now: the records emitted so far, compacted (``drain``: nothing held back)."""
        records = self._records
        out: list[Record] = []
        compactor = self.compactor
        try:
            while records:  # after taking the requests: whatever was emitted before them is in
                record = records.popleft()
                if compactor is None:
                    out.append(record)
                else:
                    compactor.feed(record, out)
            if compactor is not None:
                if drain:
                    compactor.drain(out)
                else:
                    compactor.tick(out)
        except Exception as exc:  # noqa: BLE001 - a bug in compaction must not cost the log: write the rest in full
            self.compactor = None
            self._report(f"log compaction failed ({exc!r}); writing every step in full from here")
            if compactor is not None:
                out.extend(compactor.abandon())
            while records:
                out.append(records.popleft())
        return out

    def _write(self, buf: bytearray, final: bool = False) -> None:
        index = self._index
        try:
            before, after = index.wrap(len(buf), final) if index is not None else (b"", b"")
        except Exception as exc:  # noqa: BLE001 - a bug in the index must not cost the log
            self._index, before, after = None, b"", b""
            self._report(f"indexing {self.path} failed ({exc!r}); the log is written without an index")
        try:
            if before:
                self._file.write(before)
            if buf:
                self._file.write(buf)
            if after:
                self._file.write(after)
            if before or buf or after:
                self._file.flush()
        except (OSError, ValueError) as exc:
            self.write_errors += 1
            if index is not None:
                index.broken = True  # where the next lines land is unknown now: no more index lines
            self._report(f"writing {self.path} failed: {exc}")

    def _report(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warn(f"ddpdoctor: {message}; training goes on, the log may be incomplete", LogWriteWarning, stacklevel=1)
