"""The stream as a sink: the runtime's way in to ``ddpdoctor.stream.sender`` (where the code lives)."""

from __future__ import annotations

from ddpdoctor.events.layout import ENDPOINT_ENV
from ddpdoctor.stream.sender import TcpSink, TeeSink, stream_tee

__all__ = ["ENDPOINT_ENV", "TcpSink", "TeeSink", "stream_tee"]
