"""Reading one rank's log file, in one go or incrementally while it grows."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ddpdoctor.events import (
    CorruptLine,
    End,
    FindingRecord,
    Fingerprint,
    GradFlags,
    Hang,
    Header,
    Layout,
    ProbeOff,
    ProcSample,
    Record,
    Step,
    UnknownRecord,
    Unused,
    decode,
)


@dataclass
class RankLog:
    """Everything one rank (one DDP model of it) logged, in file order."""

    rank: int
    ddp: int
    path: Path
    header: Header | None = None  # the first header; ``headers`` has later ones (after a rewrap)
    headers: list[Header] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    grad_flags: list[GradFlags] = field(default_factory=list)
    fingerprints: list[Fingerprint] = field(default_factory=list)
    unused: list[Unused] = field(default_factory=list)
    findings: list[FindingRecord] = field(default_factory=list)
    layouts: list[Layout] = field(default_factory=list)
    procs: list[ProcSample] = field(default_factory=list)
    probes_off: list[ProbeOff] = field(default_factory=list)
    hangs: list[Hang] = field(default_factory=list)  # watchdog records, stalled and resumed
    end: End | None = None
    corrupt_lines: int = 0  # not JSON: garbage, or a line torn by a crash
    unknown_lines: int = 0  # JSON, but not a record this version knows
    torn_tail: bool = False  # the file ends in the middle of a line

    def add(self, record: Record) -> None:
        if isinstance(record, Step):
            self.steps.append(record)
        elif isinstance(record, ProcSample):
            self.procs.append(record)
        elif isinstance(record, Layout):
            self.layouts.append(record)
        elif isinstance(record, Header):
            if self.header is None:
                self.header = record
            self.headers.append(record)
        elif isinstance(record, Fingerprint):
            self.fingerprints.append(record)
        elif isinstance(record, GradFlags):
            self.grad_flags.append(record)
        elif isinstance(record, Unused):
            self.unused.append(record)
        elif isinstance(record, FindingRecord):
            self.findings.append(record)
        elif isinstance(record, End):
            self.end = record
        elif isinstance(record, ProbeOff):
            self.probes_off.append(record)
        elif isinstance(record, Hang):
            self.hangs.append(record)

    def segments(self) -> list[tuple[Header, int, int | None]]:
        """(header, first step, first step of the next header or None) for each DDP instance seen."""
        out = []
        for i, h in enumerate(self.headers):
            nxt = self.headers[i + 1].first_step if i + 1 < len(self.headers) else None
            out.append((h, h.first_step, nxt))
        return out


def parse_name(path: Path) -> tuple[int, int] | None:
    """(rank, ddp index) from ``rank-00003.jsonl`` / ``rank-00003.ddp1.jsonl``; None otherwise."""
    name = path.name
    if not (name.startswith("rank-") and name.endswith(".jsonl")):
        return None
    middle = name[len("rank-") : -len(".jsonl")]
    rank_part, _, ddp_part = middle.partition(".ddp")
    try:
        return int(rank_part), int(ddp_part) if ddp_part else 0
    except ValueError:
        return None


class RankFileTail:
    """Incremental reader: each ``poll()`` decodes the complete lines appended since the last.

    A partial last line is held back until its newline arrives (``final=True`` counts it as torn
    instead). A file that shrank (truncated or replaced) is read again from the start.
    """

    def __init__(self, path: Path, rank: int, ddp: int, keep: bool = True) -> None:
        self.path = path
        self.keep = keep  # add records to ``self.log`` (False: a live reader keeps its own state)
        self.log = RankLog(rank=rank, ddp=ddp, path=path)
        self._offset = 0
        self._partial = b""
        self._inode: int | None = None

    def poll(self, final: bool = False, max_bytes: int | None = None) -> list[Record]:
        """New records since the last call (also added to ``self.log`` when ``keep``).

        ``max_bytes`` bounds what one call reads (a live view catching up on a long file stays
        responsive); None reads to the end.
        """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if st.st_size < self._offset or (self._inode is not None and st.st_ino != self._inode):
            self._offset, self._partial = 0, b""
        self._inode = st.st_ino
        out: list[Record] = []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            while True:
                chunk = f.read(max_bytes if max_bytes is not None else 64 << 20)
                if not chunk:
                    break
                self._offset += len(chunk)
                data = self._partial + chunk
                lines = data.split(b"\n")
                self._partial = lines.pop()
                for line in lines:
                    self._decode(line, out)
                if max_bytes is not None:
                    break
        if final and self._partial:
            self.log.torn_tail = True
            self.log.corrupt_lines += 1
            self._partial = b""
        return out

    def _decode(self, line: bytes, out: list[Record]) -> None:
        if not line.strip():
            return
        try:
            record = decode(line)
        except CorruptLine:
            self.log.corrupt_lines += 1
            return
        except UnknownRecord:
            self.log.unknown_lines += 1
            return
        if self.keep:
            self.log.add(record)
        out.append(record)
