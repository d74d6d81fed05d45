"""Encoding records to JSON lines and decoding them back."""

from __future__ import annotations

import msgspec

from ddpdoctor.errors import InputError
from ddpdoctor.events.schema import Record


def _as_list(obj: object) -> list[object]:
    """A record's bucket column built by the native extension (``Column``: doubles, not a float
    object a bucket) as the list it stands for; msgspec asks for the types it does not know."""
    tolist = getattr(type(obj), "tolist", None)
    if tolist is None:
        raise NotImplementedError(f"ddpdoctor cannot encode {type(obj).__name__}")
    return tolist(obj)  # type: ignore[no-any-return]


_encoder = msgspec.json.Encoder(enc_hook=_as_list)
_decoder: msgspec.json.Decoder[Record] = msgspec.json.Decoder(Record)


class CorruptLine(InputError, ValueError):
    """A line that is not valid JSON (torn or garbage)."""


class UnknownRecord(InputError, ValueError):
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
