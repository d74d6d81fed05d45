"""The stream as a sink: a rank's records over TCP to ``watch --listen``, ``collect`` or a relay.

The stream is a copy: the local run-dir file stays the source of truth (``TeeSink`` writes to
both). Training never waits for the network: ``emit`` appends to a bounded deque, a daemon thread
connects, sends and reconnects with exponential backoff; records that do not fit, or that were
in flight when a connection broke, are dropped and counted. The wire format is
``ddpdoctor.events.wire``; the receiving end, on the reading side, is ``ddpdoctor.stream``, which
this module never imports (a training rank loads none of the reading side).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence

from ddpdoctor.categories import LogWriteWarning, warn
from ddpdoctor.events import Record, StreamDrops, encode_into, environment
from ddpdoctor.events.layout import ENDPOINT_ENV, TOKEN_ENV
from ddpdoctor.events.wire import Hello, encode_hello, encode_stats, parse_endpoint
from ddpdoctor.sinks.background import BackgroundSink, Request
from ddpdoctor.sinks.base import Sink

__all__ = ["ENDPOINT_ENV", "TcpSink", "TeeSink", "stream_tee"]

#: Records waiting to be sent; beyond this they are dropped and counted (memory stays bounded).
MAX_QUEUE = 20_000
SEND_INTERVAL_S = 0.2
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
CONNECT_TIMEOUT_S = 2.0
#: A receiver that takes no bytes for this long is treated as gone (the send times out).
SEND_TIMEOUT_S = 5.0
KEEPALIVE_S = 15.0
#: Least interval between two drop reports written to the local log.
DROP_REPORT_S = 10.0
#: What ``TeeSink.close`` gives the stream before the local file closes: the sender's last
#: connect and send are cut to fit in it, so its final drop count still reaches the file.
STREAM_CLOSE_S = 2.0


class TcpSink(BackgroundSink):
    """Sends records to ``endpoint`` from a daemon thread; never blocks, drops and counts instead.

    ``sent`` and ``dropped`` are running totals; ``connects`` counts successful connections.
    ``on_drops(total)`` is called from the sender thread when the drop count has grown (at most
    every ``DROP_REPORT_S``, and once more at close), so the owner can log it where it is safe.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        rank: int,
        ddp: int = 0,
        run: str = "",
        attempt: int | None = None,
        token: str | None = None,
        max_queue: int = MAX_QUEUE,
        on_drops: Callable[[int], None] | None = None,
        send_interval: float = SEND_INTERVAL_S,
    ) -> None:
        self.endpoint = endpoint
        self.host, self.port = parse_endpoint(endpoint)
        self.on_drops = on_drops
        self.sent = 0
        self.connects = 0
        self._interval = send_interval
        token = token if token is not None else (environment.read(TOKEN_ENV) or None)
        self._hello = encode_hello(
            Hello(rank=rank, ddp=ddp, run=run, attempt=attempt, token=token, host=socket.gethostname(), pid=os.getpid())
        )
        self._init_queue(max_queue)  # receiver slow or down: training does not wait
        self._sock: socket.socket | None = None
        self._backoff = BACKOFF_MIN_S
        self._next_connect = 0.0
        self._reported_drops = 0  # as last told to the receiver
        self._logged_drops = 0  # as last handed to on_drops
        self._last_log = 0.0
        self._last_send = time.monotonic()
        self._deadline: float | None = None  # set by close: the last connect and sends must end by then
        self._abandoned = False  # close gave up waiting: deliver nothing more, the count is final
        self._thread = threading.Thread(target=self._run, name=f"ddpdoctor-stream:{rank}", daemon=True)
        self._thread.start()

    # -- sender thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            requests = self._take_requests()
            stop = any(r.stop for r in requests)
            ok = False
            try:
                ok = self._send_pending(final=stop)
            except Exception as exc:  # noqa: BLE001 - a bug here must cost the stream, never the training
                self._disconnect()
                self._warn(f"streaming to {self.endpoint} failed: {type(exc).__name__}: {exc}")
            if stop:
                self.dropped += len(self._records)  # could not be delivered before the deadline
                self._records.clear()
                self._send_stats()
            self._report_drops(force=stop)
            for request in requests:
                request.ok = ok
                request.done.set()
            if stop:
                self._disconnect()
                return

    def _remaining(self) -> float | None:
        """Seconds left before close's deadline (None: no close asked)."""
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _send_pending(self, final: bool) -> bool:
        now = time.monotonic()
        if self._sock is None and (now >= self._next_connect or final):
            left = self._remaining()
            if left is None or left > 0.05:
                self._connect(CONNECT_TIMEOUT_S if left is None else min(CONNECT_TIMEOUT_S, left))
        if self._sock is None or self._abandoned:
            return False
        while self._records:
            buf = bytearray()
            if self.dropped != self._reported_drops:
                self._stats_into(buf)
            batch = 0
            while self._records and len(buf) < (1 << 20):
                encode_into(self._records.popleft(), buf)
                batch += 1
            if not self._sendall(buf):
                self.dropped += batch  # in flight when the connection broke: delivery unknown
                return False
            self.sent += batch
        if self.dropped != self._reported_drops or now - self._last_send >= KEEPALIVE_S:
            return self._send_stats()
        return True

    def _stats_into(self, buf: bytearray) -> None:
        buf += encode_stats(self.sent, self.dropped)
        self._reported_drops = self.dropped

    def _send_stats(self) -> bool:
        if self._sock is None:
            return False
        buf = bytearray()
        self._stats_into(buf)
        return self._sendall(buf)

    def _connect(self, timeout: float) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
            sock.settimeout(SEND_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(self._hello)
        except OSError:
            self._next_connect = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            return
        self._sock = sock
        self._backoff = BACKOFF_MIN_S
        self._last_send = time.monotonic()
        self._reported_drops = -1  # a new receiver learns the running totals at once
        self.connects += 1

    def _sendall(self, buf: bytes | bytearray) -> bool:
        sock = self._sock
        if sock is None or self._abandoned:
            return False
        try:
            left = self._remaining()
            if left is not None:  # closing: the send must end by the deadline too
                if left <= 0:
                    raise TimeoutError("close deadline passed")
                sock.settimeout(min(SEND_TIMEOUT_S, left))
            sock.sendall(buf)
        except OSError:  # refused, reset, or no progress for SEND_TIMEOUT_S: reconnect later
            self._disconnect()
            self._next_connect = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            return False
        self._last_send = time.monotonic()
        return True

    def _disconnect(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _report_drops(self, force: bool) -> None:
        if self.on_drops is None or self.dropped == self._logged_drops:
            return
        now = time.monotonic()
        if not force and now - self._last_log < DROP_REPORT_S:
            return
        self._last_log = now
        self._logged_drops = self.dropped
        try:
            self.on_drops(self.dropped)
        except Exception as exc:  # noqa: BLE001 - the owner's callback must not stop the sender
            self._warn(f"could not log the stream's drop count: {exc}")

    _warned = False

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warn(f"ddpdoctor: {message}; training goes on, the local log is complete", LogWriteWarning, stacklevel=1)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the sender within ``timeout``: a send already blocked is cut off at the deadline.

        Whatever is still queued then is dropped and counted; ``on_drops`` is called with the final
        total before this returns, unless the thread could not be stopped in time (then the count
        in ``dropped`` plus ``queued`` is what was lost, and the thread delivers nothing more).
        """
        if self._closed:
            return
        self._deadline = time.monotonic() + max(0.0, timeout - 0.1)
        self._closed = True
        if not self._thread.is_alive():
            return
        request = Request(stop=True)
        self._requests.append(request)
        self._wake.set()
        if request.done.wait(max(0.0, timeout - 0.1)):
            return
        # blocked in a send that began before the close: shut the socket so sendall fails now
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if not request.done.wait(0.1):
            self._abandoned = True  # still in a connect: whatever happens next is not delivered

    @property
    def queued(self) -> int:
        """Records waiting to be sent."""
        return len(self._records)


class TeeSink(Sink):
    """Every record to ``primary`` (the local file, the source of truth) and to ``secondary``.

    The copy never costs the original: ``flush`` waits for the primary only (the secondary is
    asked to flush, not waited for: a training thread that flushes must not wait on the network),
    and ``close`` gives the secondary at most ``STREAM_CLOSE_S`` before the primary closes.
    ``before_primary_close`` runs in between (the stream's final drop count goes into the file).
    """

    def __init__(self, primary: Sink, secondary: Sink, before_primary_close: Callable[[], None] | None = None) -> None:
        self.primary = primary
        self.secondary = secondary
        self.before_primary_close = before_primary_close

    def emit(self, record: Record) -> None:
        self.primary.emit(record)
        try:
            self.secondary.emit(record)
        except Exception:  # noqa: BLE001, S110 - the copy must never cost the original
            pass

    def emit_many(self, records: Sequence[Record]) -> None:
        self.primary.emit_many(records)
        try:
            self.secondary.emit_many(records)
        except Exception:  # noqa: BLE001, S110 - the copy must never cost the original
            pass

    def flush(self, timeout: float = 5.0) -> bool:
        ok = self.primary.flush(timeout)
        try:
            self.secondary.flush(0.0)  # asked, not awaited
        except Exception:  # noqa: BLE001, S110 - the copy must never cost the original
            pass
        return ok

    def accelerate(self, extension: object) -> None:
        self.primary.accelerate(extension)

    def close(self, timeout: float = 5.0) -> None:
        # the stream first: its final drop count is written to the primary before that closes
        try:
            self.secondary.close(min(timeout, STREAM_CLOSE_S))
        finally:
            try:
                if self.before_primary_close is not None:
                    self.before_primary_close()
            finally:
                self.primary.close(timeout)


class _DropLog:
    """Writes the stream's running drop count into the local file, never after that file closed."""

    def __init__(self, primary: Sink, rank: int, ddp: int, endpoint: str) -> None:
        self.primary = primary
        self.rank, self.ddp, self.endpoint = rank, ddp, endpoint
        self.logged = 0
        self._closed = False
        self._lock = threading.Lock()  # the sender thread and the closing thread both write

    def __call__(self, total: int) -> None:
        with self._lock:
            if not self._closed and total != self.logged:
                self._emit(total)

    def final(self, total: int) -> None:
        """The last count, from the closing thread; later reports from the sender go nowhere."""
        with self._lock:
            if not self._closed and total != self.logged:
                self._emit(total)
            self._closed = True

    def _emit(self, total: int) -> None:
        self.logged = total
        self.primary.emit(
            StreamDrops(rank=self.rank, ddp=self.ddp, t_wall_ns=time.time_ns(), endpoint=self.endpoint, dropped=total)
        )


def stream_tee(
    primary: Sink,
    endpoint: str,
    *,
    rank: int,
    ddp: int = 0,
    run: str = "",
    attempt: int | None = None,
    token: str | None = None,
) -> Sink:
    """``primary`` teed with a ``TcpSink`` to ``endpoint``; drops are logged to ``primary``.

    The drop count goes into the local log as a ``stream_drops`` record (running total; the
    stream, not the file, lost them): at most every ``DROP_REPORT_S`` and at close, also when
    the receiver is down then. A malformed endpoint warns and returns ``primary`` alone.
    """
    try:
        host, port = parse_endpoint(endpoint)
    except ValueError as exc:
        warn(f"ddpdoctor: not streaming ({exc}); the local log is written as usual", LogWriteWarning, stacklevel=3)
        return primary
    drops = _DropLog(primary, rank, ddp, f"{host}:{port}")
    sink = TcpSink(endpoint, rank=rank, ddp=ddp, run=run, attempt=attempt, token=token, on_drops=drops)

    def final_count() -> None:
        # normally the sender reported it already; if it could not stop in time, what it still
        # holds is lost as well
        drops.final(sink.dropped + (sink.queued if sink._thread.is_alive() else 0))

    return TeeSink(primary, sink, before_primary_close=final_count)
