"""The per-rank append-only log file, written by a background thread."""

from __future__ import annotations

import os
import queue
import threading
import time
import warnings
from pathlib import Path

from ddpdoctor.categories import LogWriteWarning
from ddpdoctor.events import Record, encode_into
from ddpdoctor.events.schema import RECORD_TYPES
from ddpdoctor.sinks.base import Sink, SinkError

#: Upper bound on how long an emitted record may sit in memory before it reaches the OS.
FLUSH_INTERVAL_S = 0.2
#: Records kept in memory when the disk cannot keep up; beyond this they are dropped and counted.
MAX_PENDING = 100_000

_STOP = object()


class _FlushRequest:
    def __init__(self) -> None:
        self.done = threading.Event()


class FileSink(Sink):
    """Appends JSON lines to ``path`` from a daemon thread.

    The training thread only puts records on a queue. The writer encodes them, writes, and
    flushes at most ``FLUSH_INTERVAL_S`` after a record arrived, so a crash or SIGKILL loses at
    most that much; ``flush``/``close`` force it. The file is opened (and the directory created)
    in the constructor so that an unwritable run dir is reported at once as ``SinkError``.
    """

    def __init__(self, path: str | os.PathLike[str], flush_interval: float = FLUSH_INTERVAL_S) -> None:
        self.path = Path(path)
        self.flush_interval = flush_interval
        self.dropped = 0
        self.write_errors = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab", buffering=1 << 16)  # noqa: SIM115 - owned by the writer
        except OSError as exc:
            raise SinkError(f"cannot open {self.path} for writing: {exc.strerror or exc}") from exc
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._pending = 0
        self._closed = False
        self._warned = False
        self._thread = threading.Thread(target=self._run, name=f"ddpdoctor-writer:{self.path.name}", daemon=True)
        self._thread.start()

    def emit(self, record: Record) -> None:
        if self._closed:
            return
        if self._pending >= MAX_PENDING:  # the disk is stuck: keep training fast, count the loss
            self.dropped += 1
            return
        self._pending += 1  # racy by design: an approximate bound is enough
        self._queue.put(record)

    def flush(self, timeout: float = 5.0) -> bool:
        if self._closed or not self._thread.is_alive():
            return False
        request = _FlushRequest()
        self._queue.put(request)
        return request.done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # -- writer thread -------------------------------------------------------------------------

    def _run(self) -> None:
        buf = bytearray()
        last_flush = time.monotonic()
        while True:
            timeout = max(0.0, last_flush + self.flush_interval - time.monotonic()) if buf else None
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if isinstance(item, RECORD_TYPES):
                self._pending -= 1
                mark = len(buf)
                try:
                    encode_into(item, buf)
                except Exception as exc:  # a record that cannot be encoded is a bug: lose it, not the log
                    del buf[mark:]
                    self._report(f"could not encode a {type(item).__name__} record: {exc}")
                if time.monotonic() - last_flush < self.flush_interval:
                    continue
            self._write(buf)
            buf.clear()
            last_flush = time.monotonic()
            if isinstance(item, _FlushRequest):
                item.done.set()
            elif item is _STOP:
                break
        try:
            self._file.close()
        except OSError as exc:
            self._report(str(exc))

    def _write(self, buf: bytearray) -> None:
        try:
            if buf:
                self._file.write(buf)
            self._file.flush()
        except (OSError, ValueError) as exc:
            self.write_errors += 1
            self._report(f"writing {self.path} failed: {exc}")

    def _report(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"ddpdoctor: {message}; training goes on, the log may be incomplete", LogWriteWarning, stacklevel=1)

