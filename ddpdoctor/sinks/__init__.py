"""Where events go: a per-rank file (default), memory (tests), null. Imports events only."""

from __future__ import annotations

from ddpdoctor.sinks.base import Sink, SinkError
from ddpdoctor.sinks.file import FileSink
from ddpdoctor.sinks.memory import MemorySink
from ddpdoctor.sinks.null import NullSink

__all__ = ["FileSink", "MemorySink", "NullSink", "Sink", "SinkError"]
