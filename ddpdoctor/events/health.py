"""What a record source lost, refused or skipped: the counts every reader shows."""

from __future__ import annotations

from typing import NamedTuple


class SourceHealth(NamedTuple):
    """What a source lost or skipped so far (shown by the UI, never fatal)."""

    corrupt_lines: int  # garbage or torn lines skipped
    unknown_lines: int  # JSON, but a record kind this version does not know
    dropped: int  # records the writers dropped (stream only: slow or absent receiver)
    refused: int = 0  # connections the receiver turned away (over its limit, bad hello or token)
    lost: int = 0  # records a sender sent that never arrived (a connection that broke)
    closed: int = 0  # streams that closed before their rank's end record

    def problems(self) -> list[str]:
        """Each non-zero count in words (empty: nothing lost or skipped), for a health line."""
        counts = (
            (self.corrupt_lines, "corrupt"),
            (self.unknown_lines, "unknown"),
            (self.dropped, "dropped"),
            (self.lost, "lost in transit"),
            (self.refused, "connections refused"),
            (self.closed, "streams closed early"),
        )
        return [f"{n} {what}" for n, what in counts if n]
