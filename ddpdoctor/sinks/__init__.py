"""Where events go: a per-rank file (default), a TCP stream, memory (tests), null. Imports events only.

The stream's sending end is a sink like the others (``tcp.py``: ``TcpSink``, ``TeeSink``,
``stream_tee``); its receiving end is the reading side's ``ddpdoctor.stream``, never imported here.
"""

from __future__ import annotations

from ddpdoctor.sinks.base import Sink, SinkError
from ddpdoctor.sinks.file import FileSink
from ddpdoctor.sinks.memory import MemorySink
from ddpdoctor.sinks.null import NullSink
from ddpdoctor.sinks.tcp import TcpSink, TeeSink

__all__ = ["FileSink", "MemorySink", "NullSink", "Sink", "SinkError", "TcpSink", "TeeSink"]
