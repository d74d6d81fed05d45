"""Where events go: a per-rank file (default), a TCP stream, memory (tests), null. Imports events only.

The stream's sinks (``TcpSink``, ``TeeSink``) live in ``ddpdoctor.stream.sender`` beside the
listener; they are resolved on first use here, as that module builds on this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpdoctor.sinks.base import Sink, SinkError
from ddpdoctor.sinks.file import FileSink
from ddpdoctor.sinks.memory import MemorySink
from ddpdoctor.sinks.null import NullSink

if TYPE_CHECKING:
    from ddpdoctor.stream.sender import TcpSink, TeeSink


def __getattr__(name: str) -> Any:
    if name in ("TcpSink", "TeeSink"):
        from ddpdoctor.stream import sender

        return getattr(sender, name)
    raise AttributeError(f"module 'ddpdoctor.sinks' has no attribute {name!r}")


__all__ = ["FileSink", "MemorySink", "NullSink", "Sink", "SinkError", "TcpSink", "TeeSink"]
