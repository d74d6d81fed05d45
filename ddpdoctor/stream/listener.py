"""The receiving end of the live stream: the listener behind ``watch --listen`` and ``collect``.

``StreamListener`` accepts the ranks' TCP streams (``ddpdoctor run --endpoint``; the sending end
is the sink ``ddpdoctor.sinks.tcp``, the wire format ``ddpdoctor.events.wire``) on a daemon thread
with one selector loop: sockets are non-blocking, nothing is ever written back, so a slow, silent
or half-open client holds at most its own slot and never stalls the others or the reader. What
it accepts is bounded: the number of connections, the length of a line, the time to say hello
and the time a connection may stay silent. Garbage is counted and skipped; an oversized line or
a bad hello closes that connection. Out of file descriptors, it stops accepting for a moment
instead of spinning.

Nothing is lost silently: a connection turned away (over ``max_connections``, a bad hello) is
counted, so is a stream that closed before its rank's end record, and so are records a sender
sent that never arrived (each sender's running total of sent records, in its stats lines, is
compared with what arrived: a gap is what a broken connection lost). ``health()`` has them all.
The listener raises its process's soft limit of open files to the hard one (a receiver of
thousands of ranks needs a descriptor each), and caps ``max_connections`` below what that allows.

Security: it binds loopback by default. Binding any other address needs a shared token
(``DDPDOCTOR_TOKEN``), which every sender must present in its hello (compared in constant time).
The token authenticates, it does not encrypt: off a trusted network, tunnel the port (ssh -L).
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import resource
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from ddpdoctor.errors import InputError
from ddpdoctor.events import CorruptLine, End, Record, UnknownRecord, decode, environment
from ddpdoctor.events.health import SourceHealth
from ddpdoctor.events.layout import TOKEN_ENV
from ddpdoctor.events.wire import CONTROL_PREFIX, decode_hello, decode_stats

#: Longest line accepted; a rank's header lists every parameter, so this is generous.
MAX_LINE = 16 << 20
#: Connections accepted at once (one per rank streaming directly); capped by the open-files limit.
MAX_CONNECTIONS = 16_384
#: Descriptors kept free for everything else the process opens (rank files, the metrics server).
FD_RESERVE = 64
#: Connections the kernel queues before they are accepted (capped by ``net.core.somaxconn``): a
#: whole job connects at once, and a full queue makes each late sender wait out a SYN retry.
BACKLOG = 4096
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
_HELLO_PREFIX = CONTROL_PREFIX + b'"hello"'


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
    received: int = 0  # record lines that arrived from it
    lost: int = 0  # records it sent that never arrived (its stats said more than came)
    ended: bool = False  # its end record arrived: a close after it is the rank finishing
    _mark: int | None = None  # (sent at the latest stats line) - (received by then)


class StreamLine(NamedTuple):
    """One record as received: who sent it, the exact line (newline included), the decoded record."""

    peer: Peer
    raw: bytes
    record: Record


class _Conn:
    __slots__ = ("sock", "addr", "buf", "peer", "opened", "last_data", "relay")

    def __init__(self, sock: socket.socket, addr: object, now: float) -> None:
        self.sock = sock
        self.addr = addr
        self.buf = bytearray()
        self.peer: Peer | None = None
        self.relay = False  # a node's relay: a hello may come again, switching the rank
        self.opened = now
        self.last_data = now


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; the soft limit now.

    Only a receiving process calls this (``watch --listen``, ``collect``), never one whose
    children train: a limit is inherited.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20) if soft != resource.RLIM_INFINITY else soft
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


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
        raise_fd_limit: raise the soft limit of open files to the hard one first (False where
            the process starts training processes, which would inherit it).
    Counters (read at any time): ``corrupt_lines``, ``unknown_lines``, ``rejected`` (bad hello
    or token), ``oversized``, ``refused`` (over ``max_connections``), ``timed_out``, ``overflow``
    (received but dropped because the reader did not keep up), ``accept_errors`` (out of file
    descriptors or memory: accepting paused for ``ACCEPT_BACKOFF_S``), ``closed_early`` (streams
    that closed before their rank's end record), and ``lost()`` (records sent, never arrived).
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
        raise_fd_limit: bool = True,
    ) -> None:
        token = token if token is not None else (environment.read(TOKEN_ENV) or None)
        if not is_loopback(host) and not token:
            raise StreamError(
                f"listening on {host or 'all interfaces'} (not loopback) needs a shared token: "
                f"set {TOKEN_ENV} here and for the senders (or listen on 127.0.0.1)"
            )
        self._token = token.encode() if token else None
        if raise_fd_limit:
            raise_open_files_limit()
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY:  # what the descriptors allow, not more: beyond it, refused and counted
            max_connections = max(1, min(max_connections, soft - FD_RESERVE))
        self.max_connections = max_connections
        self.max_line = max_line
        self.hello_timeout = hello_timeout
        self.idle_timeout = idle_timeout
        self.max_pending = max_pending
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.create_server((host, port), family=family, backlog=min(BACKLOG, max_connections))
        self._server.setblocking(False)
        self.host = host
        self.port: int = self._server.getsockname()[1]
        self.peers: dict[tuple[str, int | None, int, int], Peer] = {}
        self.corrupt_lines = self.unknown_lines = self.rejected = self.oversized = 0
        self.refused = self.timed_out = self.overflow = self.accept_errors = self.closed_early = 0
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

    def lost(self) -> int:
        """Records the senders sent that never arrived here (connections that broke)."""
        return sum(p.lost for p in list(self.peers.values()))

    def health(self) -> SourceHealth:
        """Everything lost, refused or skipped so far, as the live view and metrics show it."""
        return SourceHealth(
            self.corrupt_lines + self.oversized,
            self.unknown_lines,
            self.dropped(),
            refused=self.refused + self.rejected,
            lost=self.lost(),
            closed=self.closed_early,
        )

    def summary(self) -> str:
        """One line of counts for a summary printed at the end (every count, zero or not)."""
        ranks = len({(p.rank, p.ddp) for p in list(self.peers.values())})
        return (
            f"{ranks} rank streams; dropped by senders: {self.dropped() - self.overflow}, "
            f"dropped here (reader behind): {self.overflow}, lost in transit: {self.lost()}; "
            f"connections refused over the limit of {self.max_connections}: {self.refused}, "
            f"rejected (bad hello or token): {self.rejected}, timed out: {self.timed_out}, "
            f"closed before their end: {self.closed_early}; lines skipped: "
            f"{self.corrupt_lines + self.oversized} corrupt, {self.unknown_lines} unknown"
        )

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
        if conn.relay and line.startswith(_HELLO_PREFIX):
            return self._hello(conn, line)
        if line.startswith(CONTROL_PREFIX):
            try:
                sent, dropped = decode_stats(line)
            except ValueError:
                self.corrupt_lines += 1
                return True
            peer = conn.peer
            if sent is not None:
                # the records sent before this line and after the previous one all came before it
                # on some connection: what did not arrive was lost with a connection that broke
                if peer._mark is not None:
                    peer.lost += max(0, sent - peer._mark - peer.received)
                peer._mark = sent - peer.received
                peer.sent = sent
            if dropped is not None:
                peer.dropped = dropped
            return True
        if not line.strip():
            return True
        conn.peer.received += 1
        try:
            record = decode(line)
        except CorruptLine:
            self.corrupt_lines += 1
            return True
        except UnknownRecord:
            self.unknown_lines += 1
            return True
        if type(record) is End:
            conn.peer.ended = True
        if len(self._lines) >= self.max_pending:
            self.overflow += 1
            return True
        self._lines.append(StreamLine(conn.peer, line, record))
        return True

    def _hello(self, conn: _Conn, line: bytes) -> bool:
        hello = decode_hello(line)
        ok = hello is not None and (conn.peer is None or hello.relay)
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
        if peer.pid != hello.pid:  # another process of that rank: its totals start over
            peer.pid, peer._mark, peer.received, peer.ended = hello.pid, None, 0, False
        if conn.peer is None:
            peer.connections += 1
            conn.relay = hello.relay
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
        if conn.peer is not None and not conn.peer.ended and not self._stop:
            self.closed_early += 1
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass
