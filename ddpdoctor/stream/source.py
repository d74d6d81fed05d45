"""The live view's record source over a stream: ``ddpdoctor watch --listen HOST:PORT``."""

from __future__ import annotations

from ddpdoctor.runlog.source import RankRecord, SourceHealth
from ddpdoctor.stream.listener import StreamListener


class StreamSource:
    """The ``RecordSource`` of a streamed run: ``ddpdoctor watch --listen HOST:PORT``.

    ``poll()`` never blocks: the network is read on the listener's thread. Records of an older
    elastic attempt stop being passed on once a newer attempt of the same run has connected.
    """

    def __init__(self, host: str, port: int, token: str | None = None) -> None:
        self.listener = StreamListener(host, port, token)
        shown = f"[{host}]" if ":" in host else host
        self.label = f"listening on {shown}:{self.listener.port}"
        self._latest: dict[str, int] = {}
        self.attempt: int | None = None  # the newest attempt connected (of any run)

    @property
    def port(self) -> int:
        return self.listener.port

    def poll(self) -> list[RankRecord]:
        taken = []
        for line in self.listener.take():
            peer = line.peer
            attempt = peer.attempt if peer.attempt is not None else -1
            latest = self._latest.get(peer.run, -1)
            if attempt < latest:
                continue
            self._latest[peer.run] = attempt
            taken.append((peer.run, attempt, RankRecord(peer.rank, peer.ddp, line.record)))
        if self._latest:
            newest = max(self._latest.values())
            self.attempt = newest if newest >= 0 else None
        # a newer attempt that connected in this batch: what its run's older attempt sent before it is stale
        return [rr for run, attempt, rr in taken if attempt == self._latest[run]]

    def health(self) -> SourceHealth:
        lis = self.listener
        return SourceHealth(lis.corrupt_lines + lis.oversized, lis.unknown_lines, lis.dropped())

    def close(self) -> None:
        self.listener.close()
