"""A rank file's lines as a sampled read needs them: by kind, with the step each holds, read on demand.

``file_lines`` uses the file's own index (``ddpdoctor.events.line_index``) where there is one: the
kind, step, rows and bucket flag of every indexed line come from the index lines, and a line's
bytes are read (``pread``) only when asked for, so a long log costs its index, not its size. What
no index line covers (a log written before the index existed, a crashed process's last lines, a
stream receiver's copy) is read and split as before. An index that does not match the file (a
line that is not where it says) raises ``IndexMismatch``: the caller scans the whole file instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path

import msgspec

from ddpdoctor.errors import InputError
from ddpdoctor.events.line_index import (
    INDEX_PREFIX,
    TAGS,
    TAIL_SEARCH_BYTES,
    IndexLine,
    decode_index,
    is_bare_line,
    last_index_in,
)

#: What the writer puts first on a step or window line (msgspec writes fields in their order):
#: the step index (and a window's row count) without decoding the line.
_HEAD = re.compile(rb'\{"kind":"(step|window)","rank":-?\d+(?:,"ddp":\d+)?,"step":(\d+)(?:,"n":(\d+))?')
#: The 5 bytes after ``{"kind":"`` of each letter of an index's ``tags`` (``o``: a kind read no further).
_TAG_BYTES = {letter: tag for tag, letter in TAGS.items()} | {"o": b"other"}
#: Lines this close together are read in one ``pread``.
_MERGE_GAP = 64 << 10
_RECORD_START = b'{"kind":"'


class IndexMismatch(InputError):
    """The file's index does not describe the file (replaced, rewritten by hand): scan it instead."""


class FileLines:
    """A rank file's complete lines (a torn last line is left out, and counted by the reader).

    ``tags[i]``: the 5 bytes after ``{"kind":"`` of line ``i``; ``head(i)``: ("step" | "window",
    first step, rows) of a step or window line (None: not as the writer puts it); ``is_bare(i)``:
    a step or window line without any bucket; ``lines[i]`` and ``many(rows)``: the bytes (no
    newline).
    """

    def __init__(
        self,
        path: Path,
        offsets: list[int],
        lengths: list[int],
        tags: list[bytes],
        heads: dict[int, tuple[str, int, int, bool]],
        held: dict[int, bytes],
    ) -> None:
        self.path = path
        self._offsets = offsets
        self._lengths = lengths
        self.tags = tags
        self._heads = heads  # from the index: line -> (kind, step, rows, bare)
        self._held = held  # lines already read (what no index covers)
        self._kinds: dict[bytes, list[int]] | None = None  # line numbers by tag, kept as lines are added

    def by_kind(self) -> dict[bytes, list[int]]:
        """Line numbers by tag, ascending (a fresh dict; the lists are shared: do not change them)."""
        if self._kinds is None:
            self._kinds = {}
            for i, tag in enumerate(self.tags):
                self._kinds.setdefault(tag, []).append(i)
        return dict(self._kinds)

    def heads(self, rows: Sequence[int]) -> list[tuple[str, int, int] | None]:
        """``head(i)`` for each of ``rows``."""
        known = self._heads
        return [(h[0], h[1], h[2]) if (h := known.get(i)) is not None else self.head(i) for i in rows]

    def __len__(self) -> int:
        return len(self.tags)

    def __getitem__(self, i: int) -> bytes:
        return self.many([i])[0]

    def head(self, i: int) -> tuple[str, int, int] | None:
        known = self._heads.get(i)
        if known is not None:
            return known[0], known[1], known[2]
        m = _HEAD.match(self[i])
        if m is None:
            return None
        return m.group(1).decode(), int(m.group(2)), int(m.group(3) or 0)

    def is_bare(self, i: int) -> bool:
        known = self._heads.get(i)
        if known is not None:
            return known[3]
        line = self[i]
        return is_bare_line(line, "s" if line[9:14] == b'step"' else "w")

    def many(self, rows: Sequence[int]) -> list[bytes]:
        """The bytes of lines ``rows`` (in that order); nearby lines are read in one call."""
        out: dict[int, bytes] = {}
        todo = sorted((self._offsets[i], i) for i in rows if i not in self._held)
        if todo:
            with open(self.path, "rb") as f:
                fd = f.fileno()
                k = 0
                while k < len(todo):
                    start = todo[k][0]
                    j = k
                    end = start + self._lengths[todo[k][1]]
                    while j + 1 < len(todo) and todo[j + 1][0] - end < _MERGE_GAP:
                        j += 1
                        end = max(end, todo[j][0] + self._lengths[todo[j][1]])
                    block = os.pread(fd, end - start, start)
                    for off, i in todo[k : j + 1]:
                        line = block[off - start : off - start + self._lengths[i]]
                        if not (line.startswith(_RECORD_START) and line.endswith(b"\n")):
                            raise IndexMismatch(f"{self.path}: no record at offset {off}")
                        out[i] = line[:-1]
                    k = j + 1
        return [self._held[i] if i in self._held else out[i] for i in rows]

    def slice(self, start: int, stop: int) -> FileLines:
        """Lines ``start`` .. ``stop - 1`` alone (one process's part of a file several wrote)."""
        return FileLines(
            self.path,
            self._offsets[start:stop],
            self._lengths[start:stop],
            self.tags[start:stop],
            {i - start: v for i, v in self._heads.items() if start <= i < stop},
            {i - start: v for i, v in self._held.items() if start <= i < stop},
        )


def scanned(path: Path, data: bytes) -> tuple[FileLines, bool]:
    """Every line of ``data`` (a whole file), read as before the index; and whether the file ends
    in a torn line (left out)."""
    lines = FileLines(path, [], [], [], {}, {})
    lines._kinds = {}
    torn = _add_region(lines, data, 0, last=True)
    return lines, torn


def _add_region(lines: FileLines, data: bytes, base: int, last: bool) -> bool:
    """Append the lines of ``data`` (file bytes from ``base``) that no index covers; True when
    ``last`` (the end of the file) and it ends in a torn line, which is left out."""
    torn = False
    if last and data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        torn = bool(data[cut:].strip())
        data = data[:cut]
    parts = data.split(b"\n")
    if parts and not parts[-1]:
        parts.pop()  # (the newline that ends the region's last line)
    offset = base
    kinds = lines._kinds
    for part in parts:
        i = len(lines.tags)
        tag = part[9:14]
        lines._offsets.append(offset)
        lines._lengths.append(len(part) + 1)
        lines.tags.append(tag)
        lines._held[i] = part
        if kinds is not None:
            kinds.setdefault(tag, []).append(i)
        offset += len(part) + 1
    return torn


def _chain(fd: int, size: int) -> list[tuple[int, int, IndexLine]]:
    """The file's index lines, first to last: (offset, length, what it says); none without an index."""
    base = max(0, size - TAIL_SEARCH_BYTES)
    found = last_index_in(os.pread(fd, size - base, base), base)
    chain: list[tuple[int, int, IndexLine]] = []
    seen: set[int] = set()
    while found is not None:
        offset, length, index = found
        if offset in seen or offset + length > size:
            raise IndexMismatch(f"index line at {offset} loops or lies past the end")
        seen.add(offset)
        chain.append(found)
        if index.prev < 0:
            break
        raw = os.pread(fd, index.prev_len, index.prev)
        if not (raw.startswith(INDEX_PREFIX) and raw.endswith(b"\n")) or index.prev + index.prev_len > offset:
            raise IndexMismatch(f"no index line at {index.prev}")
        try:
            found = (index.prev, index.prev_len, decode_index(raw[:-1]))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise IndexMismatch(f"unreadable index line at {index.prev}: {exc}") from None
    chain.reverse()
    return chain


def file_lines(path: Path) -> tuple[FileLines, bool] | None:
    """The lines of a rank file by its index (and whether it ends in a torn line); None when it
    has no index (or is missing). ``IndexMismatch`` when the index does not describe the file."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return None
    with f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        chain = _chain(fd, size)
        if not chain:
            return None
        lines = FileLines(path, [], [], [], {}, {})
        lines._kinds = {}
        covered = 0  # the end of what was read or indexed so far
        for offset, length, index in chain:
            start = index.from_
            if start < covered or sum(index.len) != offset - start or len(index.len) != len(index.tags):
                raise IndexMismatch(f"index line at {offset} does not match the lines before it")
            if start > covered:  # lines no index covers: another process's, or a crashed one's last
                _add_region(lines, os.pread(fd, start - covered, covered), covered, last=False)
            _add_indexed(lines, index, start)
            covered = offset + length
        torn = (
            _add_region(lines, os.pread(fd, size - covered, covered), covered, last=True) if size > covered else False
        )
        return lines, torn


def _add_indexed(lines: FileLines, index: IndexLine, start: int) -> None:
    tags = index.tags
    if not (len(index.step) == len(index.n) == len(index.bare) == tags.count("s") + tags.count("w")):
        raise IndexMismatch("an index line's step columns do not match its tags")
    if not set(tags) <= _TAG_BYTES.keys():
        raise IndexMismatch(f"an index line has tags this version does not know: {set(tags) - _TAG_BYTES.keys()}")
    first = len(lines.tags)
    # (comprehensions, not a loop over the lines: a long log's index holds millions of them)
    lines._offsets += accumulate(index.len[:-1], initial=start)
    lines._lengths += index.len
    lines.tags += [_TAG_BYTES[t] for t in tags]
    kinds = lines._kinds
    if kinds is not None:
        found: dict[str, list[int]] = {letter: [] for letter in set(tags)}
        appends = {letter: rows.append for letter, rows in found.items()}
        for i, t in enumerate(tags, first):
            appends[t](i)
        for letter, at in found.items():
            kinds.setdefault(_TAG_BYTES[letter], []).extend(at)
    rows = [first + i for i, t in enumerate(tags) if t == "s" or t == "w"]
    names = ["step" if tags[i - first] == "s" else "window" for i in rows]
    bare = [b == "1" for b in index.bare]
    lines._heads.update(zip(rows, zip(names, index.step, index.n, bare, strict=True), strict=True))
