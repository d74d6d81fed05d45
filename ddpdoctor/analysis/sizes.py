"""Sizes and names of logged tensors, for findings: bytes from dtype names, name lists (no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ddpdoctor.events import Header

_DTYPE_BYTES = {
    "float64": 8,
    "double": 8,
    "int64": 8,
    "long": 8,
    "complex64": 8,
    "complex128": 16,
    "float32": 4,
    "float": 4,
    "int32": 4,
    "int": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "int16": 2,
    "short": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES.get(dtype, 4)


def param_bytes(header: Header, names: list[str]) -> int:
    """Bytes of the named parameters' gradients (as DDP would all-reduce them)."""
    wanted = set(names)
    return sum(p.numel * dtype_bytes(p.dtype) for p in header.params if p.name in wanted)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def first_seen(records: Sequence[Any], attr: str) -> tuple[list[str], int | None]:
    """The names listed in ``attr`` of step-stamped records, in first-seen order, and the first
    step any of them appeared at."""
    names: list[str] = []
    first: int | None = None
    for record in records:
        for name in getattr(record, attr):
            if name not in names:
                names.append(name)
                first = record.step if first is None else min(first, record.step)
    return names, first


def counted(n: int, noun: str) -> str:
    """'1 step', '5 steps' for messages (a noun with its plural in -s)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def name_list(names: list[str], most: int = 6) -> str:
    """'a, b, c and 4 more' for messages."""
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"
