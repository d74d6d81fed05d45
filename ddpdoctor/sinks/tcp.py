"""Streaming a rank's records over TCP to ``ddpdoctor watch --listen`` or ``ddpdoctor collect``.

The stream is a copy: the local run-dir file stays the source of truth (``TeeSink`` writes to
both). Training never waits for the network: ``emit`` appends to a bounded deque, a daemon thread
connects, sends and reconnects with exponential backoff; records that do not fit, or that were
in flight when a connection broke, are dropped and counted.

Wire format (one JSON object per line, UTF-8):

- first line, the hello: ``{"ddpdoctor": "hello", "v": 1, "token": ..., "rank": R, "ddp": D,
  "run": NAME, "attempt": N | null, "host": ..., "pid": ...}``;
- then records, encoded exactly as in the rank files;
- control lines between them, ``{"ddpdoctor": "stats", "sent": S, "dropped": N}``: the sender's
  running totals (sent whenever the drop count moved, and every ``KEEPALIVE_S`` as a keepalive).

A record line always starts with ``{"kind":``; a control line with ``{"ddpdoctor":``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from collections.abc import Callable

import msgspec

from ddpdoctor.categories import LogWriteWarning
from ddpdoctor.events import Record, StreamDrops, encode_into
from ddpdoctor.sinks.background import BackgroundSink
from ddpdoctor.sinks.base import Sink

#: Where ``instrument`` streams when no ``endpoint`` is given (set by ``ddpdoctor run --endpoint``).
ENDPOINT_ENV = "DDPDOCTOR_ENDPOINT"
#: The shared secret presented in the hello (required by a listener bound off loopback).
TOKEN_ENV = "DDPDOCTOR_TOKEN"
PROTOCOL = 1
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

_encoder = msgspec.json.Encoder()


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); ValueError when malformed."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint must be HOST:PORT, got {text!r}")
    return host, int(port)


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
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self._hello = _encoder.encode({
            "ddpdoctor": "hello", "v": PROTOCOL, "token": token, "rank": rank, "ddp": ddp, "run": run,
            "attempt": attempt, "host": socket.gethostname(), "pid": os.getpid(),
        }) + b"\n"
        self._init_queue(max_queue)  # receiver slow or down: training does not wait
        self._sock: socket.socket | None = None
        self._backoff = BACKOFF_MIN_S
        self._next_connect = 0.0
        self._reported_drops = 0  # as last told to the receiver
        self._logged_drops = 0  # as last handed to on_drops
        self._last_log = 0.0
        self._last_send = time.monotonic()
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
            except Exception as exc:  # a bug here must cost the stream, never the training
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

    def _send_pending(self, final: bool) -> bool:
        now = time.monotonic()
        if self._sock is None and (now >= self._next_connect or final):
            self._connect()
        if self._sock is None:
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
        buf += _encoder.encode({"ddpdoctor": "stats", "sent": self.sent, "dropped": self.dropped})
        buf += b"\n"
        self._reported_drops = self.dropped

    def _send_stats(self) -> bool:
        if self._sock is None:
            return False
        buf = bytearray()
        self._stats_into(buf)
        return self._sendall(buf)

    def _connect(self) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
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
        assert self._sock is not None
        try:
            self._sock.sendall(buf)
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
        except Exception as exc:
            self._warn(f"could not log the stream's drop count: {exc}")

    _warned = False

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"ddpdoctor: {message}; training goes on, the local log is complete", LogWriteWarning,
                          stacklevel=1)


class TeeSink(Sink):
    """Every record to ``primary`` (the local file, the source of truth) and to ``secondary``."""

    def __init__(self, primary: Sink, secondary: Sink) -> None:
        self.primary = primary
        self.secondary = secondary

    def emit(self, record: Record) -> None:
        self.primary.emit(record)
        try:
            self.secondary.emit(record)
        except Exception:  # the copy must never cost the original
            pass

    def flush(self, timeout: float = 5.0) -> bool:
        ok = self.primary.flush(timeout)
        self.secondary.flush(min(timeout, 0.5))
        return ok

    def close(self, timeout: float = 5.0) -> None:
        # the stream first: its final drop count is written to the primary before that closes
        try:
            self.secondary.close(min(timeout, 2.0))
        finally:
            self.primary.close(timeout)


def stream_tee(primary: Sink, endpoint: str, *, rank: int, ddp: int = 0, run: str = "",
               attempt: int | None = None, token: str | None = None) -> Sink:
    """``primary`` teed with a ``TcpSink`` to ``endpoint``; drops are logged to ``primary``.

    The drop count goes into the local log as a ``stream_drops`` record (running total; the
    stream, not the file, lost them): at most every ``DROP_REPORT_S`` and at close.
    A malformed endpoint warns and returns ``primary`` alone.
    """
    try:
        host, port = parse_endpoint(endpoint)
    except ValueError as exc:
        warnings.warn(f"ddpdoctor: not streaming ({exc}); the local log is written as usual", LogWriteWarning,
                      stacklevel=3)
        return primary

    def log_drops(total: int) -> None:
        primary.emit(StreamDrops(rank=rank, ddp=ddp, t_wall_ns=time.time_ns(), endpoint=f"{host}:{port}",
                                 dropped=total))

    sink = TcpSink(endpoint, rank=rank, ddp=ddp, run=run, attempt=attempt, token=token, on_drops=log_drops)
    return TeeSink(primary, sink)
