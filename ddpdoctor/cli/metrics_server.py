"""``--metrics HOST:PORT``: the live state of a run in Prometheus's text format (``/metrics``).

``MetricsServer`` serves whatever a callable returns, a ``LiveSnapshot`` (or None before the
first records), through a custom prometheus-client collector: the metrics are built from the
snapshot at scrape time, so a rank that is gone leaves no stale series behind, and nothing is
computed between scrapes. It needs only that callable, so it sits beside the live view
(``watch``: the snapshot the screen shows) or a ``LiveRun`` of its own (``collect``: ``LiveFeed``).

Labels are ``run``, ``rank``, ``host`` (plus ``phase``, ``status``, ``code``, ``severity`` with
fixed value sets). No step or bucket label, ever: the number of series is bounded by the number
of ranks (about 20 per rank), whatever the run length or the bucket count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ddpdoctor.analysis.live_run import LiveRun
from ddpdoctor.analysis.live_view import STATUSES, LiveSnapshot, RankView
from ddpdoctor.runlog.source import RankRecord, SourceHealth
from ddpdoctor.stream.listener import StreamLine, StreamListener

SnapshotFn = Callable[[], "LiveSnapshot | None"]
PHASES = ("forward", "buffer_sync", "backward", "allreduce")
HEALTHS = ("waiting", "ok", "warning", "error")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); ValueError with a readable message."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--metrics wants HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def phase_ms(row: RankView) -> dict[str, float | None]:
    """The rank's phases at its latest step, named as the report names them (ms)."""
    if row.step is None:
        return {}
    buckets = [b for b in row.buckets if b.name != "bcast"]
    ready = [b.ready_ms for b in buckets if b.ready_ms is not None]
    done = [b.done_ms for b in buckets if b.done_ms is not None]
    return {
        "forward": row.fwd_ms,
        "buffer_sync": row.bcast_ms if row.bcast_ms is not None else 0.0,  # no broadcast: none of the step
        "backward": row.bwd_ms,
        "allreduce": max(done) - min(ready) if ready and done else None,
    }


class SnapshotCollector(Collector):
    """A prometheus-client collector over ``snapshot()``: metric families built at scrape time."""

    def __init__(self, snapshot: SnapshotFn, run: str | None = None) -> None:
        self._snapshot = snapshot
        self._run = run
        # last known per-rank values: a rank's final step has no duration (it is the time to the
        # next step's start), so a finished run would lose its step time; bounded by ranks x metrics
        self._last: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()  # scrapes may run on several server threads at once

    def describe(self) -> list[Metric]:
        return []  # the families depend on the snapshot: no describe-time call into it

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        up = GaugeMetricFamily("ddpdoctor_up", "1 once ddpdoctor has received records of the run", labels=["run"])
        run = (
            self._run
            or (snap.run_id if snap is not None and snap.run_id else (snap.label if snap else ""))
            or "unknown"
        )
        up.add_metric([run], 1.0 if snap is not None and snap.records else 0.0)
        yield up
        if snap is None:
            return
        yield from self._run_metrics(snap, run)
        with self._lock:
            yield from self._rank_metrics(snap, run)

    @staticmethod
    def _run_metrics(snap: LiveSnapshot, run: str) -> Iterator[Metric]:
        g = GaugeMetricFamily
        world = g("ddpdoctor_world_size", "ranks in the run", labels=["run"])
        world.add_metric([run], snap.world_size)
        yield world
        if snap.latest_step is not None:
            latest = g("ddpdoctor_latest_step", "highest step any rank logged", labels=["run"])
            latest.add_metric([run], snap.latest_step)
            yield latest
        if snap.steps_per_s is not None:
            rate = g("ddpdoctor_steps_per_second", "training steps per second (recent)", labels=["run"])
            rate.add_metric([run], snap.steps_per_s)
            yield rate
        model = g("ddpdoctor_ddp_model", "the DDP model of each process these metrics follow (--ddp K)", labels=["run"])
        model.add_metric([run], snap.ddp)
        yield model
        finished = g("ddpdoctor_run_finished", "1 when every rank closed its log", labels=["run"])
        finished.add_metric([run], 1.0 if snap.finished else 0.0)
        yield finished
        health = g("ddpdoctor_run_health", "1 for the run's current health", labels=["run", "health"])
        for h in HEALTHS:
            health.add_metric([run, h], 1.0 if snap.health == h else 0.0)
        yield health
        counts: dict[tuple[str, str], int] = {}
        for f in snap.findings:
            counts[(f.code, f.severity)] = counts.get((f.code, f.severity), 0) + 1
        findings = g("ddpdoctor_findings", "live findings by code and severity", labels=["run", "code", "severity"])
        for (code, severity), n in sorted(counts.items()):
            findings.add_metric([run, code, severity], n)
        yield findings
        received = CounterMetricFamily("ddpdoctor_records_received", "records received from the ranks", labels=["run"])
        received.add_metric([run], snap.records)
        yield received
        src: SourceHealth = snap.source
        dropped = CounterMetricFamily(
            "ddpdoctor_records_dropped", "records lost on the way (dropped by senders or the receiver)", labels=["run"]
        )
        dropped.add_metric([run], src.dropped)
        yield dropped
        skipped = CounterMetricFamily(
            "ddpdoctor_lines_skipped", "lines skipped: corrupt or of an unknown kind", labels=["run", "reason"]
        )
        skipped.add_metric([run, "corrupt"], src.corrupt_lines)
        skipped.add_metric([run, "unknown"], src.unknown_lines)
        yield skipped
        c = CounterMetricFamily
        lost = c(
            "ddpdoctor_records_lost", "records a sender sent that never arrived (broken connections)", labels=["run"]
        )
        lost.add_metric([run], src.lost)
        yield lost
        refused = c(
            "ddpdoctor_connections_refused", "stream connections refused (over the limit, bad hello)", labels=["run"]
        )
        refused.add_metric([run], src.refused)
        yield refused
        closed = c(
            "ddpdoctor_streams_closed_early", "streams that closed before their rank's end record", labels=["run"]
        )
        closed.add_metric([run], src.closed)
        yield closed

    def _value(self, family: GaugeMetricFamily, labels: list[str], value: float | None) -> None:
        key = (family.name, *labels)
        if value is None:
            value = self._last.get(key)
        else:
            self._last[key] = float(value)
        if value is not None:
            family.add_metric(labels, float(value))

    def _rank_metrics(self, snap: LiveSnapshot, run: str) -> Iterator[Metric]:
        labels = ["run", "rank", "host"]
        g = GaugeMetricFamily
        fams: dict[str, GaugeMetricFamily] = {
            "step": g("ddpdoctor_rank_step_seconds", "the rank's latest step time", labels=labels),
            "phase": g(
                "ddpdoctor_rank_phase_seconds", "the rank's phase times at its latest step", labels=[*labels, "phase"]
            ),
            "wait": g(
                "ddpdoctor_rank_wait_seconds",
                "time blocked in the step's collectives waiting for slower ranks",
                labels=labels,
            ),
            "late": g(
                "ddpdoctor_rank_lateness_seconds",
                "how late the rank reached the step's collectives, behind the earliest rank",
                labels=labels,
            ),
            "lost": g(
                "ddpdoctor_rank_lost_for_others_seconds",
                "wall time the run lost waiting for this rank over the live view's last 64 complete steps",
                labels=labels,
            ),
            "number": g("ddpdoctor_rank_step", "the rank's latest step number", labels=labels),
            "status": g("ddpdoctor_rank_status", "1 for the rank's current status", labels=[*labels, "status"]),
            "cpu": g("ddpdoctor_rank_cpu_percent", "CPU use of the rank's process", labels=labels),
            "rss": g("ddpdoctor_rank_rss_bytes", "resident memory of the rank's process", labels=labels),
        }
        add = self._value
        seen = set()
        for row in snap.ranks:
            key = [run, str(row.rank), row.host or ""]
            seen.add(tuple(key))
            add(fams["step"], key, _s(row.step_ms))
            for phase in PHASES:
                add(fams["phase"], [*key, phase], _s(phase_ms(row).get(phase)))
            add(fams["wait"], key, _s(row.wait_ms))
            add(fams["late"], key, _s(row.late_ms))
            add(fams["lost"], key, _s(row.lost_for_others_ms))
            add(fams["number"], key, row.step)
            for status in STATUSES:
                fams["status"].add_metric([*key, status], 1.0 if row.status == status else 0.0)
            add(fams["cpu"], key, row.cpu_pct)
            add(fams["rss"], key, row.rss_bytes)
        # forget ranks that left the snapshot (a new elastic attempt, a replaced run)
        self._last = {k: v for k, v in self._last.items() if tuple(k[1:4]) in seen}
        yield from fams.values()


class MetricsServer:
    """``/metrics`` on HOST:PORT (port 0: a free one, see ``port``), on a daemon thread."""

    def __init__(self, address: str, snapshot: SnapshotFn, run: str | None = None) -> None:
        host, port = parse_address(address)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(snapshot, run))
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host = host
        self.port = int(self._server.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class LiveFeed:
    """A ``LiveRun`` fed from a stream listener's lines, for ``collect --metrics``.

    ``feed`` is called by the collector's loop with the lines it just wrote; ``snapshot`` by the
    metrics server's thread at scrape time. A lock keeps the two apart (``LiveRun`` is not
    thread-safe); a snapshot is only computed when Prometheus asks for one. Only the latest
    elastic attempt of the first run seen is followed, as the collector writes it, and of its
    DDP models the one ``ddp`` names (``collect --ddp K``; the others are named in the snapshot).
    """

    def __init__(self, listener: StreamListener, ddp: int = 0) -> None:
        self._listener = listener
        self._lock = threading.Lock()
        self._ddp = ddp
        self._live = LiveRun(ddp=ddp)
        self._run: str | None = None
        self._attempt = -1

    def feed(self, lines: list[StreamLine]) -> None:
        with self._lock:
            records: list[RankRecord] = []
            for line in lines:
                peer = line.peer
                if self._run is None:
                    self._run = peer.run
                elif peer.run != self._run:
                    continue
                attempt = peer.attempt if peer.attempt is not None else -1
                if attempt < self._attempt:
                    continue
                if attempt > self._attempt:  # torchrun restarted the workers: a fresh live state
                    self._attempt = attempt
                    self._live = LiveRun(label=self._live.label, attempt=peer.attempt, ddp=self._ddp)
                    records = []
                records.append(RankRecord(peer.rank, peer.ddp, line.record))
            self._live.set_source_health(self._listener.health())
            if records:
                self._live.feed(records)

    def snapshot(self) -> LiveSnapshot | None:
        with self._lock:
            return self._live.snapshot() if self._run is not None else None
