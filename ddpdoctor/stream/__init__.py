"""The live stream's receiving end, on the reading side; the wire format is ``ddpdoctor.events.wire``.

- ``listener``: ``StreamListener`` (one selector thread, bounded, loopback or token). Imports events.
- ``source``: ``StreamSource``, the listener as the live view's ``RecordSource``. Imports runlog.
- ``relay``: ``StreamRelay``, a node's ranks to a receiver over one connection (``run --metrics``):
  it sends lines a listener received, as they came, so it needs no sink.

The sending end is a sink, ``ddpdoctor.sinks.tcp``; neither side imports the other, so a training
rank that streams loads nothing of this package.
"""

from __future__ import annotations

from ddpdoctor.stream.listener import Peer, StreamError, StreamLine, StreamListener
from ddpdoctor.stream.relay import StreamRelay
from ddpdoctor.stream.source import StreamSource

__all__ = ["Peer", "StreamError", "StreamLine", "StreamListener", "StreamRelay", "StreamSource"]
