"""Receiving streamed runs: the listener behind ``ddpdoctor watch --listen`` and ``ddpdoctor collect``.

``StreamListener`` accepts the ranks' TCP streams (``ddpdoctor run --endpoint``, wire format in
``ddpdoctor.sinks.tcp``) on a daemon thread with one selector loop: sockets are non-blocking,
nothing is ever written back, so a slow, silent or half-open client holds at most its own slot
and never stalls the others or the reader. What it accepts is bounded: the number of
connections, the length of a line, the time to say hello and the time a connection may stay
silent. Garbage is counted and skipped; an oversized line or a bad hello closes that connection.

Security: it binds loopback by default. Binding any other address needs a shared token
(``DDPDOCTOR_TOKEN``), which every sender must present in its hello (compared in constant time).
The token authenticates, it does not encrypt: off a trusted network, tunnel the port (ssh -L).

``StreamSource`` is the ``RecordSource`` the live view polls; ``ddpdoctor collect`` reads the
listener's raw lines and writes the usual run-dir layout.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from ddpdoctor.events import CorruptLine, Record, UnknownRecord, decode
from ddpdoctor.runlog.source import RankRecord, SourceHealth

TOKEN_ENV = "DDPDOCTOR_TOKEN"
PROTOCOL = 1
#: Longest line accepted; a rank's header lists every parameter, so this is generous.
MAX_LINE = 16 << 20
MAX_CONNECTIONS = 512
#: Seconds a new connection has to send its hello.
HELLO_TIMEOUT_S = 5.0
#: Seconds a connection may stay silent (senders send a keepalive every 15 s).
IDLE_TIMEOUT_S = 120.0
#: Lines received but not yet taken by the reader; beyond this they are dropped and counted.
MAX_PENDING = 500_000
_CONTROL = b'{"ddpdoctor":'
_RECV = 1 << 16


class StreamError(ValueError):
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
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


class StreamListener:
    """Accepts rank streams on ``host:port`` (port 0: any free port; ``port`` tells which).

    Args:
        token: the shared secret senders must present; default ``$DDPDOCTOR_TOKEN``. Required
            (``StreamError``) when ``host`` is not a loopback address.
    Counters (read at any time): ``corrupt_lines``, ``unknown_lines``, ``rejected`` (bad hello
    or token), ``oversized``, ``refused`` (over ``max_connections``), ``timed_out``, ``overflow``
    (received but dropped because the reader did not keep up).
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
            raise StreamError(f"listening on {host or 'all interfaces'} (not loopback) needs a shared token: "
                              f"set {TOKEN_ENV} here and for the senders (or listen on 127.0.0.1)")
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
        self.refused = self.timed_out = self.overflow = 0
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
                for key, _ in self._selector.select(timeout=0.5):
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
            except OSError:  # e.g. out of file descriptors: try again on the next event
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
            if not self._line(conn, bytes(buf[start:end + 1])):
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
        if line.startswith(_CONTROL):
            try:
                msg = json.loads(line)
                conn.peer.sent = int(msg.get("sent", conn.peer.sent))
                conn.peer.dropped = int(msg.get("dropped", conn.peer.dropped))
            except (ValueError, TypeError, AttributeError, RecursionError):
                self.corrupt_lines += 1
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
        try:
            msg = json.loads(line)
            ok = (isinstance(msg, dict) and msg.get("ddpdoctor") == "hello" and msg.get("v") == PROTOCOL
                  and isinstance(msg.get("rank"), int) and msg["rank"] >= 0
                  and isinstance(msg.get("ddp", 0), int) and msg.get("ddp", 0) >= 0
                  and isinstance(msg.get("run", ""), str)
                  and (msg.get("attempt") is None or (isinstance(msg["attempt"], int) and msg["attempt"] >= 0)))
        except (ValueError, RecursionError):
            ok = False
        if ok and self._token is not None:
            given = msg.get("token")
            ok = isinstance(given, str) and hmac.compare_digest(given.encode(), self._token)
        if not ok:
            self.rejected += 1
            return False
        key = (msg.get("run", ""), msg.get("attempt"), msg["rank"], msg.get("ddp", 0))
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = Peer(run=key[0], attempt=key[1], rank=key[2], ddp=key[3])
        peer.host = str(msg.get("host", ""))[:256]
        peer.pid = msg.get("pid", 0) if isinstance(msg.get("pid"), int) else 0
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


class StreamSource:
    """The ``RecordSource`` of a streamed run: ``ddpdoctor watch --listen HOST:PORT``.

    ``poll()`` never blocks: the network is read on the listener's thread. Records of an older
    elastic attempt stop being passed on once a newer attempt of the same run has connected.
    """

    def __init__(self, host: str, port: int, token: str | None = None) -> None:
        self.listener = StreamListener(host, port, token)
        shown = f"[{host}]" if ":" in host else host
        self.label = f"listening on {shown}:{self.listener.port}"
        self._latest: dict[str, int] = {}
        self.attempt: int | None = None  # the newest attempt connected (of any run)

    @property
    def port(self) -> int:
        return self.listener.port

    def poll(self) -> list[RankRecord]:
        taken = []
        for line in self.listener.take():
            peer = line.peer
            attempt = peer.attempt if peer.attempt is not None else -1
            latest = self._latest.get(peer.run, -1)
            if attempt < latest:
                continue
            self._latest[peer.run] = attempt
            taken.append((peer.run, attempt, RankRecord(peer.rank, peer.ddp, line.record)))
        if self._latest:
            newest = max(self._latest.values())
            self.attempt = newest if newest >= 0 else None
        # a newer attempt that connected in this batch: what its run's older attempt sent before it is stale
        return [rr for run, attempt, rr in taken if attempt == self._latest[run]]

    def health(self) -> SourceHealth:
        lis = self.listener
        return SourceHealth(lis.corrupt_lines + lis.oversized, lis.unknown_lines, lis.dropped())

    def close(self) -> None:
        self.listener.close()
