"""A node's ranks to a receiver over one connection: the fan-in relay of ``ddpdoctor run``.

Where ``ddpdoctor run --metrics`` listens to its own node's ranks (``StreamListener`` on
loopback), ``--endpoint`` is reached through it: ``StreamRelay`` sends every rank's lines on
one connection, announcing a rank with its hello (``relay: true``) whenever the lines switch
to it. The receiver (a listener of this version) then keeps one connection per node, not per
rank, and still files every line under its rank.

Like a rank's own sender it never blocks the reader that feeds it and loses nothing silently:
lines that do not fit its bounded queue, or were in flight when the connection broke, are added
to that rank's dropped count; each rank's stats line (its own drops plus the relay's, and the
lines the relay sent for it) goes out on every new connection and whenever a count moves, so the
receiver counts what a broken connection lost as it does for a rank (``Peer.lost``).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque

from ddpdoctor.events import environment
from ddpdoctor.events.layout import TOKEN_ENV
from ddpdoctor.events.wire import Hello, encode_hello, encode_stats, parse_endpoint
from ddpdoctor.stream.listener import Peer, StreamLine

#: Lines waiting to go upstream; beyond this they are dropped and counted under their rank.
MAX_QUEUE = 200_000
SEND_INTERVAL_S = 0.2
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 5.0
CONNECT_TIMEOUT_S = 2.0
SEND_TIMEOUT_S = 5.0
#: Most bytes sent in one ``sendall``.
_BATCH = 1 << 20

_Key = tuple[str, int | None, int, int]


class _Counts:
    __slots__ = ("sent", "dropped", "reported")

    def __init__(self) -> None:
        self.sent = 0  # lines of this rank the relay handed to the socket
        self.dropped = 0  # lines of this rank the relay lost (queue full, connection broke)
        self.reported: tuple[int, int] | None = None  # (sent, dropped) as last told upstream


class StreamRelay:
    """Sends the lines ``put`` gives it to ``endpoint`` from a daemon thread, on one connection.

    ``sent``, ``dropped`` (the relay's own, over all ranks) and ``connects`` are running totals.
    """

    def __init__(self, endpoint: str, token: str | None = None, max_queue: int = MAX_QUEUE) -> None:
        self.endpoint = endpoint
        self.host, self.port = parse_endpoint(endpoint, what="--endpoint")
        self._token = token if token is not None else (environment.read(TOKEN_ENV) or None)
        self._queue: deque[StreamLine] = deque()
        self._max_queue = max_queue
        self._lock = threading.Lock()
        self._counts: dict[_Key, _Counts] = {}
        self._peers: dict[_Key, Peer] = {}
        self.sent = self.dropped = self.connects = 0
        self._sock: socket.socket | None = None
        self._current: _Key | None = None  # the rank the connection's lines belong to now
        self._backoff = BACKOFF_MIN_S
        self._next_connect = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpdoctor-relay", daemon=True)
        self._thread.start()

    @staticmethod
    def _key(peer: Peer) -> _Key:
        return (peer.run, peer.attempt, peer.rank, peer.ddp)

    def put(self, lines: list[StreamLine]) -> None:
        """Queue lines for upstream (never blocks; what does not fit is dropped and counted)."""
        with self._lock:
            for line in lines:
                key = self._key(line.peer)
                if key not in self._counts:
                    self._counts[key] = _Counts()
                    self._peers[key] = line.peer
                if len(self._queue) >= self._max_queue:
                    self._counts[key].dropped += 1
                    self.dropped += 1
                    continue
                self._queue.append(line)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for at most ``timeout``), then the final counts, and stop."""
        self._deadline = time.monotonic() + max(0.0, timeout - 0.1)
        self._stop.set()
        self._thread.join(timeout)

    _deadline: float | None = None

    # -- relay thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(SEND_INTERVAL_S)
            try:
                self._send(final=stopping)
            except Exception:  # noqa: BLE001 - a bug here must cost the copy, never the run
                self._disconnect()
            if stopping:
                with self._lock:  # what could not be sent before the deadline is lost: say so
                    for line in self._queue:
                        self._counts[self._key(line.peer)].dropped += 1
                        self.dropped += 1
                    self._queue.clear()
                if self._sock is not None:
                    self._send_stats(force=True)
                self._disconnect()
                return

    def _send(self, final: bool) -> None:
        now = time.monotonic()
        # (connected only with something to say: a receiver closes a connection silent past its hello timeout)
        if self._sock is None and (now >= self._next_connect or final) and (self._queue or self._counts):
            self._connect()
        if self._sock is None:
            return
        while True:
            if self._deadline is not None and time.monotonic() > self._deadline:
                return
            buf = bytearray()
            batch: list[tuple[_Key, int]] = []
            with self._lock:
                while self._queue and len(buf) < _BATCH:
                    line = self._queue.popleft()
                    key = self._key(line.peer)
                    if key != self._current:
                        buf += self._hello(line.peer)
                        self._current = key
                    buf += line.raw
                    batch.append((key, 1))
            if not batch:
                break
            if not self._sendall(buf):
                with self._lock:  # in flight when the connection broke: delivery unknown
                    for key, n in batch:
                        self._counts[key].dropped += n
                        self.dropped += n
                return
            with self._lock:
                for key, n in batch:
                    self._counts[key].sent += n
                    self.sent += n
        self._send_stats(force=False)

    def _hello(self, peer: Peer) -> bytes:
        return encode_hello(
            Hello(
                rank=peer.rank,
                ddp=peer.ddp,
                run=peer.run,
                attempt=peer.attempt,
                token=self._token,
                host=peer.host,
                pid=peer.pid,
                relay=True,
            )
        )

    def _send_stats(self, force: bool) -> None:
        """Each rank's totals whose numbers moved (all of them on a new connection, or ``force``)."""
        buf = bytearray()
        with self._lock:
            for key, counts in self._counts.items():
                peer = self._peers[key]
                now = (counts.sent, counts.dropped + peer.dropped)
                if force or counts.reported != now:
                    if key != self._current:
                        buf += self._hello(peer)
                        self._current = key
                    buf += encode_stats(*now)
                    counts.reported = now
        if buf:
            self._sendall(buf)

    def _connect(self) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
            sock.settimeout(SEND_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            self._next_connect = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            return
        self._sock = sock
        self._current = None  # the next line announces its rank
        self._backoff = BACKOFF_MIN_S
        self.connects += 1
        with self._lock:
            for counts in self._counts.values():
                counts.reported = None  # a new connection learns every rank's totals first
        self._send_stats(force=True)

    def _sendall(self, buf: bytes | bytearray) -> bool:
        sock = self._sock
        if sock is None:
            return False
        try:
            sock.sendall(buf)
        except OSError:
            self._disconnect()
            self._next_connect = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            return False
        return True

    def _disconnect(self) -> None:
        sock, self._sock = self._sock, None
        self._current = None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
