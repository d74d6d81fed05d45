"""The live view's record source over a stream: ``ddpdoctor watch --listen HOST:PORT``."""

from __future__ import annotations

from ddpdoctor.runlog.source import RankRecord, SourceHealth
from ddpdoctor.stream.listener import StreamListener


class StreamSource:
    """The ``RecordSource`` of a streamed run: ``ddpdoctor watch --listen HOST:PORT``.

    ``poll()`` never blocks: the network is read on the listener's thread. One run is shown: the
    newest to connect (its first rank's hello came last; a rank of a run already seen that
    reconnects does not move the view). Records of other runs are dropped and counted
    (``other_runs``, ``ignored``), and the label names the run followed: when it changes, what came
    before belongs to another run (``poll_source`` starts afresh). Within the run, records of an
    older elastic attempt stop being passed on once a newer attempt has connected.
    """

    def __init__(self, host: str, port: int, token: str | None = None) -> None:
        self.listener = StreamListener(host, port, token)
        shown = f"[{host}]" if ":" in host else host
        self._listening = f"listening on {shown}:{self.listener.port}"
        self.label = self._listening
        self.run: str | None = None  # the run followed (None: no rank has said hello yet)
        self._seen: set[str] = set()  # every run that connected, bounded by the runs sent here
        self._latest = -1  # the newest attempt of the run followed
        self.attempt: int | None = None
        self.ignored = 0  # records of other runs, dropped

    @property
    def port(self) -> int:
        return self.listener.port

    @property
    def other_runs(self) -> int:
        """Runs that connected here and are not shown."""
        return len(self._seen) - (self.run is not None)

    def poll(self) -> list[RankRecord]:
        taken: list[tuple[int, RankRecord]] = []
        for line in self.listener.take():
            peer = line.peer
            if peer.run not in self._seen:  # a run that never connected before: show it
                self._seen.add(peer.run)
                self.run, self._latest, taken = peer.run, -1, []
                self.label = f"{self._listening}, run {peer.run}" if peer.run else self._listening
            if peer.run != self.run:
                self.ignored += 1
                continue
            attempt = peer.attempt if peer.attempt is not None else -1
            if attempt < self._latest:
                continue
            self._latest = attempt
            taken.append((attempt, RankRecord(peer.rank, peer.ddp, line.record)))
        self.attempt = self._latest if self._latest >= 0 else None
        # a newer attempt that connected in this batch: what the older one sent before it is stale
        return [rr for attempt, rr in taken if attempt == self._latest]

    def health(self) -> SourceHealth:
        return self.listener.health()

    def close(self) -> None:
        self.listener.close()
