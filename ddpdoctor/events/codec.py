"""Encoding records to JSON lines and decoding them back."""

from __future__ import annotations

import msgspec

from ddpdoctor.events.schema import Record

_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[Record] = msgspec.json.Decoder(Record)


class CorruptLine(ValueError):
    """A line that is not valid JSON (torn or garbage)."""


class UnknownRecord(ValueError):
    """Valid JSON, but not a record this version understands."""


def encode(record: Record) -> bytes:
    """One record as a JSON line, newline included."""
    return _encoder.encode(record) + b"\n"


def encode_into(record: Record, buf: bytearray) -> None:
    """Append one record as a JSON line to ``buf`` (no intermediate bytes object)."""
    _encoder.encode_into(record, buf, -1)
    buf.extend(b"\n")


def decode(line: bytes | str) -> Record:
    """Decode one line; raises CorruptLine or UnknownRecord instead of msgspec's errors."""
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise UnknownRecord(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise CorruptLine(str(exc)) from None
