"""``ddpdoctor run --metrics HOST:PORT``: this node's ranks, served for Prometheus, relayed onward.

The ranks of the node stream to a listener of this process on loopback (one connection each,
nothing leaves the node for that); a ``LiveFeed`` keeps their live state, which ``/metrics``
serves, so Prometheus scrapes every node as it scrapes a node exporter and no central ddpdoctor
process is needed for metrics. With ``--endpoint`` too, a ``StreamRelay`` sends the node's ranks
to that receiver over one connection (``watch --listen`` or ``collect`` then hold one socket per
node, not per rank).
"""

from __future__ import annotations

import threading

from ddpdoctor.cli.metrics_server import LiveFeed, MetricsServer
from ddpdoctor.stream.listener import StreamListener
from ddpdoctor.stream.relay import StreamRelay

#: How often the node's lines are taken from the listener, fed and relayed.
FEED_INTERVAL_S = 0.2


class NodeStream:
    """The listener, live state, metrics server and (with ``endpoint``) relay of one node.

    ``endpoint`` (what the ranks stream to: this listener) goes into the ranks' environment.
    Raises ``ValueError`` or ``OSError`` when the metrics address is malformed or taken.
    """

    def __init__(self, metrics: str, endpoint: str | None = None, ddp: int = 0) -> None:
        # (the open-files limit stays as it is: the training processes started here inherit it)
        self.listener = StreamListener("127.0.0.1", 0, raise_fd_limit=False)
        try:
            self.feed = LiveFeed(self.listener, ddp=ddp)
            self.metrics = MetricsServer(metrics, self.feed.snapshot)
        except (ValueError, OSError):
            self.listener.close()
            raise
        self.relay = StreamRelay(endpoint) if endpoint else None
        self.endpoint = f"127.0.0.1:{self.listener.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpdoctor-node-stream", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        lines = self.listener.take()
        if lines:
            self.feed.feed(lines)
            if self.relay is not None:
                self.relay.put(lines)

    def _run(self) -> None:
        while not self._stop.wait(FEED_INTERVAL_S):
            self._pump()

    def close(self, timeout: float = 5.0) -> str:
        """Stop: the last lines fed and relayed (for at most ``timeout``); a line saying what the
        node's stream received, and what it lost or refused."""
        self._stop.set()
        self._thread.join(timeout)
        self.listener.close()
        self._pump()
        summary = f"this node's ranks: {self.listener.summary()}"
        if self.relay is not None:
            self.relay.close(timeout)
            summary += (
                f"; relayed to {self.relay.endpoint}: {self.relay.sent} records over "
                f"{self.relay.connects} connection(s), {self.relay.dropped} dropped by the relay"
            )
        self.metrics.close()
        return summary
