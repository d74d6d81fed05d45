"""The live stream, both ends side by side; the wire format they share is ``ddpdoctor.events.wire``.

- ``sender``: ``TcpSink`` (a rank's records to a listener, never blocking training), ``TeeSink``
  and ``stream_tee`` (the local file plus the stream). Writing side: imports events and sinks.
- ``listener``: ``StreamListener`` (one selector thread, bounded, loopback or token). Imports events.
- ``source``: ``StreamSource``, the listener as the live view's ``RecordSource``. Imports runlog.
- ``relay``: ``StreamRelay``, a node's ranks to a receiver over one connection (``run --metrics``).

Nothing is imported here eagerly: a training rank that streams loads the sender alone, never the
reading side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpdoctor.stream.listener import Peer, StreamError, StreamLine, StreamListener
    from ddpdoctor.stream.sender import TcpSink, TeeSink, stream_tee
    from ddpdoctor.stream.source import StreamSource

_HOME = {
    "TcpSink": "sender",
    "TeeSink": "sender",
    "stream_tee": "sender",
    "Peer": "listener",
    "StreamError": "listener",
    "StreamLine": "listener",
    "StreamListener": "listener",
    "StreamSource": "source",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'ddpdoctor.stream' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ddpdoctor.stream.{module}"), name)


__all__ = ["Peer", "StreamError", "StreamLine", "StreamListener", "StreamSource", "TcpSink", "TeeSink", "stream_tee"]
