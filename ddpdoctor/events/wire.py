"""The live stream's wire protocol: what a sender (``sinks.tcp``) and a listener (``stream.listener``) say.

One JSON object per line, UTF-8, over TCP:

- first line, the hello: ``{"ddpdoctor": "hello", "v": 1, "token": ..., "rank": R, "ddp": D,
  "run": NAME, "attempt": N | null, "host": ..., "pid": ...}``;
- then records, encoded exactly as in the rank files (``events.codec``);
- control lines between them, ``{"ddpdoctor": "stats", "sent": S, "dropped": N}``: the sender's
  running totals.

A relay (``ddpdoctor run --metrics`` on a node, ``stream.relay``) sends many ranks on one
connection: its hellos carry ``"relay": true``, and on such a connection a hello may come again
between records: the lines after it, stats lines included, are that rank's. (A listener older
than relays would file every rank's lines under the first hello's rank: a relay needs a listener
of this version. A rank's own stream is unchanged.)

A record line always starts with ``{"kind":``; a control line with ``CONTROL_PREFIX``. The token
variable is ``layout.TOKEN_ENV``. Endpoints on the command line and in the environment are
``HOST:PORT`` (``[::1]:PORT`` for IPv6), read by ``parse_endpoint`` alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import msgspec

#: Version of the hello and control lines; a listener refuses a hello of another version.
PROTOCOL = 1
#: How a control line (hello, stats) starts, byte for byte, as the sender encodes it.
CONTROL_PREFIX = b'{"ddpdoctor":'

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class Hello:
    """Who a stream comes from: a rank's DDP model of one run attempt."""

    rank: int
    ddp: int = 0
    run: str = ""
    attempt: int | None = None
    token: str | None = None
    host: str = ""
    pid: int = 0
    relay: bool = False  # sent by a relay: more hellos follow on this connection, one per rank


def encode_hello(hello: Hello) -> bytes:
    """The hello line (newline included)."""
    return (
        _encoder.encode(
            {
                "ddpdoctor": "hello",
                "v": PROTOCOL,
                "token": hello.token,
                "rank": hello.rank,
                "ddp": hello.ddp,
                "run": hello.run,
                "attempt": hello.attempt,
                "host": hello.host,
                "pid": hello.pid,
                **({"relay": True} if hello.relay else {}),
            }
        )
        + b"\n"
    )


def decode_hello(line: bytes) -> Hello | None:
    """The hello a line carries, or None when it is not a valid hello of this protocol version."""
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(msg, dict) and msg.get("ddpdoctor") == "hello" and msg.get("v") == PROTOCOL):
        return None
    rank, ddp, run, attempt = msg.get("rank"), msg.get("ddp", 0), msg.get("run", ""), msg.get("attempt")
    if not (
        isinstance(rank, int)
        and rank >= 0
        and isinstance(ddp, int)
        and ddp >= 0
        and isinstance(run, str)
        and (attempt is None or (isinstance(attempt, int) and attempt >= 0))
    ):
        return None
    token = msg.get("token")
    pid = msg.get("pid", 0)
    return Hello(
        rank=rank,
        ddp=ddp,
        run=run,
        attempt=attempt,
        token=token if isinstance(token, str) else None,
        host=str(msg.get("host", ""))[:256],
        pid=pid if isinstance(pid, int) else 0,
        relay=msg.get("relay") is True,
    )


def encode_stats(sent: int, dropped: int) -> bytes:
    """A stats control line (newline included): the sender's running totals."""
    return _encoder.encode({"ddpdoctor": "stats", "sent": sent, "dropped": dropped}) + b"\n"


def decode_stats(line: bytes) -> tuple[int | None, int | None]:
    """(sent, dropped) from a control line (None for a total it lacks); ValueError when unreadable."""
    try:
        msg = json.loads(line)
        sent, dropped = msg.get("sent"), msg.get("dropped")
        return (None if sent is None else int(sent)), (None if dropped is None else int(dropped))
    except (TypeError, AttributeError, RecursionError) as exc:
        raise ValueError(f"not a control line: {exc}") from None


def parse_endpoint(text: str, *, listen: bool = False, what: str = "endpoint") -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); ValueError with a readable message.

    Args:
        listen: the address to bind rather than to connect to: port 0 (any free port) is allowed,
            and an empty host (``:PORT``) means every interface (``0.0.0.0``).
        what: how the message names the value (``--listen``, ``--endpoint``).
    """
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    lowest = 0 if listen else 1
    if not sep or not port.isdigit() or not lowest <= int(port) < 65536 or not (host or listen):
        raise ValueError(f"{what} wants HOST:PORT, got {text!r}")
    return host or "0.0.0.0", int(port)
