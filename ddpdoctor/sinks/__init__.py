"""Where events go: a per-rank file (default), a TCP stream, memory (tests), null. Imports events only."""

from __future__ import annotations

from ddpdoctor.sinks.base import Sink, SinkError
from ddpdoctor.sinks.file import FileSink
from ddpdoctor.sinks.memory import MemorySink
from ddpdoctor.sinks.null import NullSink
from ddpdoctor.sinks.tcp import TcpSink, TeeSink

__all__ = ["FileSink", "MemorySink", "NullSink", "Sink", "SinkError", "TcpSink", "TeeSink"]
