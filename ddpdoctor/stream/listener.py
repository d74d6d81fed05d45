"""The receiving end of the live stream: the listener behind ``watch --listen`` and ``collect``.

``StreamListener`` accepts the ranks' TCP streams (``ddpdoctor run --endpoint``; the sending end
is ``ddpdoctor.stream.sender``, the wire format ``ddpdoctor.events.wire``) on a daemon thread
with one selector loop: sockets are non-blocking, nothing is ever written back, so a slow, silent
or half-open client holds at most its own slot and never stalls the others or the reader. What
it accepts is bounded: the number of connections, the length of a line, the time to say hello
and the time a connection may stay silent. Garbage is counted and skipped; an oversized line or
a bad hello closes that connection. Out of file descriptors, it stops accepting for a moment
instead of spinning.

Security: it binds loopback by default. Binding any other address needs a shared token
(``DDPDOCTOR_TOKEN``), which every sender must present in its hello (compared in constant time).
The token authenticates, it does not encrypt: off a trusted network, tunnel the port (ssh -L).
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import os
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from ddpdoctor.errors import InputError
from ddpdoctor.events import CorruptLine, Record, UnknownRecord, decode
from ddpdoctor.events.layout import TOKEN_ENV
from ddpdoctor.events.wire import CONTROL_PREFIX, decode_hello, decode_stats

#: Longest line accepted; a rank's header lists every parameter, so this is generous.
MAX_LINE = 16 << 20
MAX_CONNECTIONS = 512
#: Seconds a new connection has to send its hello.
HELLO_TIMEOUT_S = 5.0
#: Seconds a connection may stay silent (senders send a keepalive every 15 s).
IDLE_TIMEOUT_S = 120.0
#: Lines received but not yet taken by the reader; beyond this they are dropped and counted.
MAX_PENDING = 500_000
#: Seconds the listener stops accepting after running out of file descriptors (or memory):
#: the pending connection keeps the socket readable, so retrying at once would spin.
ACCEPT_BACKOFF_S = 0.25
_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_RECV = 1 << 16


class StreamError(InputError, ValueError):
    """The listener cannot be set up as asked (e.g. a non-loopback bind without a token)."""


@dataclass
class Peer:
    """One sender: a rank's DDP model of one run attempt, as its hello introduced it."""

    run: str
    attempt: int | None
    rank: int
    ddp: int
    host: str = ""
    pid: int = 0
    sent: int = 0  # the sender's own totals, from its latest stats line
    dropped: int = 0
    connections: int = 0


class StreamLine(NamedTuple):
    """One record as received: who sent it, the exact line (newline included), the decoded record."""

    peer: Peer
    raw: bytes
    record: Record


class _Conn:
    __slots__ = ("sock", "addr", "buf", "peer", "opened", "last_data")

    def __init__(self, sock: socket.socket, addr: object, now: float) -> None:
        self.sock = sock
        self.addr = addr
        self.buf = bytearray()
        self.peer: Peer | None = None
        self.opened = now
        self.last_data = now


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


class StreamListener:
    """Accepts rank streams on ``host:port`` (port 0: any free port; ``port`` tells which).

    Args:
        token: the shared secret senders must present; default ``$DDPDOCTOR_TOKEN``. Required
            (``StreamError``) when ``host`` is not a loopback address.
    Counters (read at any time): ``corrupt_lines``, ``unknown_lines``, ``rejected`` (bad hello
    or token), ``oversized``, ``refused`` (over ``max_connections``), ``timed_out``, ``overflow``
    (received but dropped because the reader did not keep up), ``accept_errors`` (out of file
    descriptors or memory: accepting paused for ``ACCEPT_BACKOFF_S``).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_line: int = MAX_LINE,
        hello_timeout: float = HELLO_TIMEOUT_S,
        idle_timeout: float = IDLE_TIMEOUT_S,
        max_pending: int = MAX_PENDING,
    ) -> None:
        token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        if not is_loopback(host) and not token:
            raise StreamError(
                f"listening on {host or 'all interfaces'} (not loopback) needs a shared token: "
                f"set {TOKEN_ENV} here and for the senders (or listen on 127.0.0.1)"
            )
        self._token = token.encode() if token else None
        self.max_connections = max_connections
        self.max_line = max_line
        self.hello_timeout = hello_timeout
        self.idle_timeout = idle_timeout
        self.max_pending = max_pending
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.create_server((host, port), family=family, backlog=128)
        self._server.setblocking(False)
        self.host = host
        self.port: int = self._server.getsockname()[1]
        self.peers: dict[tuple[str, int | None, int, int], Peer] = {}
        self.corrupt_lines = self.unknown_lines = self.rejected = self.oversized = 0
        self.refused = self.timed_out = self.overflow = self.accept_errors = 0
        self._accept_paused_until: float | None = None
        self._lines: deque[StreamLine] = deque()
        self._conns: dict[int, _Conn] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=f"ddpdoctor-listen:{self.port}", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        return len(self._conns)

    def dropped(self) -> int:
        """Records lost on the way: what the senders reported dropping, plus this side's overflow."""
        return sum(p.dropped for p in list(self.peers.values())) + self.overflow

    def take(self) -> list[StreamLine]:
        """Everything received since the last call (never blocks)."""
        out = []
        lines = self._lines
        while lines:
            out.append(lines.popleft())
        return out

    def close(self, timeout: float = 2.0) -> None:
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)

    # -- the selector loop (listener thread) ---------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop:
                if self._accept_paused_until is not None and time.monotonic() >= self._accept_paused_until:
                    self._accept_paused_until = None
                    self._selector.register(self._server, selectors.EVENT_READ, None)
                timeout = 0.5 if self._accept_paused_until is None else min(0.5, ACCEPT_BACKOFF_S)
                for key, _ in self._selector.select(timeout=timeout):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        continue
                    else:
                        self._read(key.data)
                self._sweep(time.monotonic())
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn)
            for sock in (self._server, self._wake_r, self._wake_w):
                try:
                    sock.close()
                except OSError:
                    pass
            self._selector.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _RESOURCE_ERRORS:
                    # the connection stays queued and the socket readable: pause instead of spinning
                    self.accept_errors += 1
                    self._selector.unregister(self._server)
                    self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF_S
                return
            if len(self._conns) >= self.max_connections:
                self.refused += 1
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, addr, time.monotonic())
            self._conns[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:  # the sender closed: a partial last line is discarded, never written
            self._drop(conn)
            return
        conn.last_data = time.monotonic()
        buf = conn.buf
        buf += data
        start = 0
        while True:
            end = buf.find(b"\n", start)
            if end < 0:
                break
            if end - start > self.max_line:
                self.oversized += 1
                self._drop(conn)
                return
            if not self._line(conn, bytes(buf[start : end + 1])):
                self._drop(conn)
                return
            start = end + 1
        del buf[:start]
        if len(buf) > self.max_line:
            self.oversized += 1
            self._drop(conn)

    def _line(self, conn: _Conn, line: bytes) -> bool:
        """Handle one complete line; False closes the connection."""
        if conn.peer is None:
            return self._hello(conn, line)
        if line.startswith(CONTROL_PREFIX):
            try:
                sent, dropped = decode_stats(line)
            except ValueError:
                self.corrupt_lines += 1
                return True
            if sent is not None:
                conn.peer.sent = sent
            if dropped is not None:
                conn.peer.dropped = dropped
            return True
        if not line.strip():
            return True
        try:
            record = decode(line)
        except CorruptLine:
            self.corrupt_lines += 1
            return True
        except UnknownRecord:
            self.unknown_lines += 1
            return True
        if len(self._lines) >= self.max_pending:
            self.overflow += 1
            return True
        self._lines.append(StreamLine(conn.peer, line, record))
        return True

    def _hello(self, conn: _Conn, line: bytes) -> bool:
        hello = decode_hello(line)
        ok = hello is not None
        if hello is not None and self._token is not None:
            ok = hello.token is not None and hmac.compare_digest(hello.token.encode(), self._token)
        if hello is None or not ok:
            self.rejected += 1
            return False
        key = (hello.run, hello.attempt, hello.rank, hello.ddp)
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = Peer(run=hello.run, attempt=hello.attempt, rank=hello.rank, ddp=hello.ddp)
        peer.host = hello.host
        peer.pid = hello.pid
        peer.connections += 1
        conn.peer = peer
        return True

    def _sweep(self, now: float) -> None:
        for conn in list(self._conns.values()):
            limit = self.hello_timeout if conn.peer is None else self.idle_timeout
            since = conn.opened if conn.peer is None else conn.last_data
            if now - since > limit:
                self.timed_out += 1
                self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass
