"""Schema of what is logged, its encoding, and the contracts both sides share: ``layout`` (run-dir names,
environment variables) and ``wire`` (the live stream's protocol). Needs msgspec only (no torch)."""

from __future__ import annotations

from ddpdoctor.events.codec import (
    CorruptLine,
    UnknownRecord,
    decode,
    encode,
    encode_into,
)
from ddpdoctor.events.schema import (
    SCHEMA_VERSION,
    BucketInfo,
    BufferInfo,
    End,
    FindingRecord,
    Fingerprint,
    GradFlags,
    Hang,
    Header,
    Layout,
    ParamInfo,
    ProbeOff,
    ProcSample,
    Record,
    Step,
    StreamDrops,
    Unused,
    Window,
)

__all__ = [
    "SCHEMA_VERSION",
    "BucketInfo",
    "BufferInfo",
    "CorruptLine",
    "End",
    "FindingRecord",
    "Fingerprint",
    "GradFlags",
    "Hang",
    "Header",
    "Layout",
    "ParamInfo",
    "ProbeOff",
    "ProcSample",
    "Record",
    "Step",
    "StreamDrops",
    "UnknownRecord",
    "Unused",
    "Window",
    "decode",
    "encode",
    "encode_into",
]
