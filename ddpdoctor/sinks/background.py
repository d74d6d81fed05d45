"""What the file and stream sinks share: records handed to one daemon thread through a deque."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from ddpdoctor.events import Record
from ddpdoctor.sinks.base import Sink


class Request:
    """A flush (or, with ``stop``, a close) asked of the sink's thread; ``done`` is set when handled."""

    def __init__(self, stop: bool = False) -> None:
        self.stop = stop
        self.done = threading.Event()
        self.ok = True  # the thread sets False when it could not deliver what was asked


class BackgroundSink(Sink):
    """The hot-path half of a thread-backed sink.

    ``emit`` appends to a deque (atomic: no lock on the training thread) and drops, counting,
    once ``max_pending`` records wait. ``flush`` and ``close`` queue a ``Request`` and wake the
    thread; subclasses start ``self._thread`` on their ``_run``, which takes the requests with
    ``_take_requests`` and answers them.
    """

    max_pending: int
    dropped: int
    _thread: threading.Thread

    def _init_queue(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self.dropped = 0
        self._records: deque[Record] = deque()
        self._requests: deque[Request] = deque()
        self._wake = threading.Event()
        self._closed = False

    def emit(self, record: Record) -> None:
        if self._closed:
            return
        if len(self._records) >= self.max_pending:  # the consumer cannot keep up: training does not wait
            self.dropped += 1
            return
        self._records.append(record)

    def emit_many(self, records: Sequence[Record]) -> None:
        if self._closed:
            return
        room = self.max_pending - len(self._records)
        if room < len(records):  # the consumer cannot keep up: the newest are dropped, counted
            self.dropped += len(records) - max(0, room)
            records = records[: max(0, room)]
        self._records.extend(records)  # (deque.extend: atomic as append is, for a list)

    def _take_requests(self) -> list[Request]:
        requests = []
        while self._requests:
            requests.append(self._requests.popleft())
        return requests

    def _request(self, stop: bool, timeout: float) -> bool:
        request = Request(stop)
        self._requests.append(request)
        self._wake.set()
        return request.done.wait(timeout) and request.ok

    def flush(self, timeout: float = 5.0) -> bool:
        if self._closed or not self._thread.is_alive():
            return False
        return self._request(False, timeout)

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            deadline = time.monotonic() + timeout
            if self._request(True, timeout) and self._thread is not threading.current_thread():
                # the thread answers, then returns: no thread of ours outlives a close
                self._thread.join(max(0.0, deadline - time.monotonic()))
