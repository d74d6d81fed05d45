"""The index a rank file carries of its own lines, so that a reader seeks instead of scanning.

Every ``INDEX_EVERY_BYTES`` of records (and when the file closes) the writer appends one index
line that describes the lines it wrote since its previous index line::

    {"kind":"index","len":[...],"tags":"...","step":[...],"n":[...],"bare":"...","prev":P,"prev_len":L,"from":F}

- ``from``: the byte offset of the first line described; the lines follow each other from there
  up to the index line itself, ``len`` their lengths (newline included), ``tags`` one letter each
  for their kind (``TAGS``; ``o``: any other kind);
- ``step``, ``n``, ``bare``: for each step (``s``) or window (``w``) line, in order, its first step,
  its rows (0 for a step record) and whether it holds no bucket (``1``: a bare step or window);
- ``prev``, ``prev_len``: where the previous index line of the file is (-1: none), found by the
  writer when it opens a file that already holds lines (a restarted rank appending to its log).

A reader (``ddpdoctor.runlog.indexed``) finds the last index line near the end of the file and
walks back along ``prev``: what no index line covers (before the first, between two processes'
lines, after the last, or a whole log written before the index existed) it scans as before. An
index line is not a record: every reader skips it (``is_index_line``).
"""

from __future__ import annotations

import os

import msgspec

from ddpdoctor.events.schema import Step, Window

#: How an index line starts, byte for byte.
INDEX_PREFIX = b'{"kind":"index"'
#: Bytes of records described by one index line (a crash leaves at most this much unindexed).
INDEX_EVERY_BYTES = 1 << 20
#: How far back from the end of a file the last index line is looked for (the writer at open,
#: the reader): an index line and the records after it fit well inside.
TAIL_SEARCH_BYTES = 4 << 20
#: The kind of a line by the 5 bytes after ``{"kind":"``, as one letter.
TAGS = {
    b'step"': "s",
    b"windo": "w",
    b"heade": "h",
    b'proc"': "p",
    b"finge": "f",
    b"unuse": "u",
    b'end",': "e",
}
_READY = b'"b_ready_us":'
_BUCKETS = b'"buckets":'
_STEP_OR_WINDOW = ("s", "w")


class IndexLine(msgspec.Struct):
    """One index line, as written and read."""

    kind: str
    len: list[int]
    tags: str
    step: list[int]
    n: list[int]
    bare: str
    prev: int = -1
    prev_len: int = 0
    from_: int = msgspec.field(default=0, name="from")


_encode = msgspec.json.Encoder().encode
decode_index = msgspec.json.Decoder(IndexLine).decode


def is_index_line(line: bytes) -> bool:
    return line.startswith(INDEX_PREFIX)


def is_bare_line(line: bytes, tag: str) -> bool:
    """Whether a step or window line holds no bucket, as the reader tells it from the bytes."""
    if tag == "s":
        return _READY not in line
    return _BUCKETS not in line[:200]


def last_index_in(tail: bytes, base: int) -> tuple[int, int, IndexLine] | None:
    """The last complete index line in ``tail`` (the bytes of a file from offset ``base``):
    (its offset in the file, its length, what it says); None when there is none."""
    end = len(tail)
    while True:
        at = tail.rfind(b"\n" + INDEX_PREFIX, 0, end)
        start = at + 1 if at >= 0 else (0 if tail.startswith(INDEX_PREFIX) and end > 0 else -1)
        if start < 0:
            return None
        stop = tail.find(b"\n", start)
        if stop >= 0:
            try:
                return base + start, stop + 1 - start, decode_index(tail[start:stop])
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
        if start == 0:
            return None
        end = at  # torn or unreadable: the one before it


class LineIndexer:
    """Builds a rank file's index lines on the writer's thread (``FileSink``).

    ``note`` is called for each record line appended to the write buffer, ``wrap`` before each
    write: what to write before the buffer's records and after them (the index line, when due).
    A write that failed leaves the offsets unknown: ``broken`` then stops the index (the reader
    scans what the last index line does not cover).
    """

    def __init__(self, path: str | os.PathLike[str], size: int) -> None:
        """``size``: the file's size as it is opened for appending (OSError: it cannot be read)."""
        self.broken = False
        self.offset = size  # where the next byte written will land
        self.prefix = b""  # written before anything else: ends a line a crash tore
        self.prev, self.prev_len = -1, 0
        if size:
            base = max(0, size - TAIL_SEARCH_BYTES)
            with open(path, "rb") as f:
                tail = os.pread(f.fileno(), size - base, base)
            if not tail.endswith(b"\n"):
                self.prefix = b"\n"  # the torn line stays one corrupt line, the next one stays whole
            found = last_index_in(tail, base)
            if found is not None:
                self.prev, self.prev_len = found[0], found[1]
        self._start()

    def _start(self) -> None:
        self.first = self.offset + len(self.prefix)
        self.lens: list[int] = []
        self.tags: list[str] = []
        self.steps: list[int] = []
        self.rows: list[int] = []
        self.bare: list[str] = []
        self.covered = 0

    def note_record(self, buf: bytearray, mark: int, record: object) -> None:
        """``note`` for the line ``buf[mark:]`` just encoded from ``record``."""
        if isinstance(record, Step):
            self.note(buf, mark, ("s", record.step, 0))
        elif isinstance(record, Window):
            self.note(buf, mark, ("w", record.step, record.n))
        else:
            self.note(buf, mark, None)

    def note(self, buf: bytearray, mark: int, kind_step_n: tuple[str, int, int] | None) -> None:
        """The line ``buf[mark:]`` was just encoded; ``kind_step_n``: ("s"|"w", step, rows) for a
        step or window record, else None (the tag is read from the line)."""
        length = len(buf) - mark
        self.lens.append(length)
        self.covered += length
        if kind_step_n is None:
            self.tags.append(TAGS.get(bytes(buf[mark + 9 : mark + 14]), "o"))
            return
        tag, step, rows = kind_step_n
        self.tags.append(tag)
        self.steps.append(step)
        self.rows.append(rows)
        # as ``is_bare_line`` tells it, without copying the line
        bare = buf.find(_READY, mark) < 0 if tag == "s" else buf.find(_BUCKETS, mark, mark + 200) < 0
        self.bare.append("1" if bare else "0")

    def wrap(self, buf_len: int, final: bool) -> tuple[bytes, bytes]:
        """What to write before and after the ``buf_len`` bytes of records about to be written:
        the newline that ends a torn line (once), and the index line when one is due (at least
        ``INDEX_EVERY_BYTES`` described, or ``final``). Nothing to write: two empty strings."""
        if not buf_len and not (final and self.lens):
            return b"", b""
        prefix, self.prefix = self.prefix, b""
        self.offset += len(prefix) + buf_len
        if self.broken or not self.lens or (self.covered < INDEX_EVERY_BYTES and not final):
            return prefix, b""
        line = IndexLine(
            kind="index",
            len=self.lens,
            tags="".join(self.tags),
            step=self.steps,
            n=self.rows,
            bare="".join(self.bare),
            prev=self.prev,
            prev_len=self.prev_len,
            from_=self.first,
        )
        data = _encode(line) + b"\n"
        self.prev, self.prev_len = self.offset, len(data)
        self.offset += len(data)
        self._start()
        return prefix, data
