"""The watcher thread: polls a record source, feeds the live analysis, posts snapshots to the app."""

from __future__ import annotations

import threading
import time

from textual.message import Message
from textual.message_pump import MessagePump

from ddpdoctor.analysis.live_run import HISTORY, LiveRun, poll_source
from ddpdoctor.analysis.live_view import LiveSnapshot
from ddpdoctor.runlog.source import RecordSource


class SnapshotReady(Message):
    """A new view of the run. A newer one supersedes one the app has not handled yet."""

    def __init__(self, snapshot: LiveSnapshot) -> None:
        super().__init__()
        self.snapshot = snapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, SnapshotReady)


class SourceError(Message):
    """The source failed in a way polling again will not fix (shown, not fatal)."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class Watcher(threading.Thread):
    """Owns the source and the ``LiveRun``: everything that reads files or sockets stays off the UI thread.

    ``view_step`` (None: follow the latest step) is set by the app; ``wake()`` makes the next
    snapshot come at once instead of at the next tick.
    """

    def __init__(
        self,
        source: RecordSource,
        target: MessagePump,
        interval: float = 0.2,
        history: int = HISTORY,
        ddp: int = 0,
    ) -> None:
        super().__init__(name="ddpdoctor-watch", daemon=True)
        self.source = source
        self.target = target
        self.interval = interval
        self.live = LiveRun(label=source.label, history=history, attempt=source.attempt, ddp=ddp)
        self.view_step: int | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def run(self) -> None:
        last_post = 0.0
        shown_view: object = object()
        failures = 0
        while not self._stopping.is_set():
            try:
                # a new elastic attempt gets a fresh LiveRun (poll_source)
                self.live, records = poll_source(self.live, self.source)
                failures = 0
            except Exception as exc:  # noqa: BLE001 - a source must not take the UI down; say it once
                records = []
                failures += 1
                if failures == 1:
                    self.target.post_message(SourceError(f"{type(exc).__name__}: {exc}"))
            self.live.set_source_health(self.source.health())
            now = time.monotonic()
            view = self.view_step
            # while catching up on a long file, post at the tick rate, not per poll
            if view != shown_view or (now - last_post >= self.interval and (records or now - last_post >= 1.0)):
                self.target.post_message(SnapshotReady(self.live.snapshot(view)))
                last_post, shown_view = now, view
            if records and len(records) >= 1000:
                continue  # more is waiting: read on without sleeping
            self._wake.wait(self.interval)
            self._wake.clear()
        try:
            self.source.close()
        except Exception:  # noqa: BLE001, S110 - closing on the way out: nothing left to tell
            pass
