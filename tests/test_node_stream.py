"""A node's ranks served for Prometheus by ``ddpdoctor run --metrics`` and relayed to one receiver
over one connection: every rank filed under its own name upstream, and what a broken upstream
connection cost counted, never silent."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.synth import rank_records
from ddpdoctor.cli.node_stream import NodeStream
from ddpdoctor.events import ProcSample, encode
from ddpdoctor.sinks.tcp import TcpSink
from ddpdoctor.stream.listener import Peer, StreamLine, StreamListener
from ddpdoctor.stream.relay import StreamRelay
from tests.ddp_harness import torchrun_cmd
from tests.test_run_cmd import EXAMPLES, ddpdoctor_run
from tests.test_stream import collect, wait_for

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    with _OPENER.open(url, timeout=10) as resp:
        text = resp.read().decode()
    return {fam.name: [(s.labels, s.value) for s in fam.samples] for fam in text_string_to_metric_families(text)}


def test_a_node_serves_its_own_ranks_and_relays_them_over_one_connection() -> None:
    upstream = StreamListener("127.0.0.1", 0)
    node = NodeStream("127.0.0.1:0", f"127.0.0.1:{upstream.port}")
    sinks = []
    try:
        for rank in range(3):
            sink = TcpSink(node.endpoint, rank=rank, run="job")
            for record in rank_records(rank, 3, 40, buckets=4):
                sink.emit(record)
            sinks.append(sink)
        per_rank = len(list(rank_records(0, 3, 40, buckets=4)))

        def scraped() -> bool:
            rows = scrape(node.metrics.url).get("ddpdoctor_rank_step", [])
            return sorted(labels["rank"] for labels, _ in rows) == ["0", "1", "2"]

        wait_for(scraped, 30, "the node's three ranks in /metrics")
        got = collect(upstream, 3 * per_rank, timeout=30)
        assert upstream.connections == 1  # the node's three ranks over one connection
        for rank in range(3):
            mine = [line.record for line in got if line.peer.rank == rank]
            assert len(mine) == per_rank and mine == list(rank_records(rank, 3, 40, buckets=4))
        assert {line.peer.run for line in got} == {"job"}
    finally:
        for sink in sinks:
            sink.close()
        summary = node.close()
        upstream.close()
    assert "3 rank streams" in summary and "0 dropped by the relay" in summary
    assert upstream.health().problems() == []


def test_the_relay_says_what_a_broken_upstream_connection_lost() -> None:
    """The upstream connection breaks mid-stream and the relay reconnects: for every rank, what
    arrived, what was lost in transit and what the relay dropped add up to what the rank sent."""
    upstream = StreamListener("127.0.0.1", 0)
    relay = StreamRelay(f"127.0.0.1:{upstream.port}")
    peers = [Peer(run="job", attempt=None, rank=r, ddp=0, host="node7", pid=100 + r) for r in range(4)]
    total = 0
    try:
        for i in range(40):
            lines = [
                StreamLine(
                    p, encode(rec := ProcSample(rank=p.rank, t_mono_ns=i, t_wall_ns=i, cpu_pct=1.0, rss_bytes=i)), rec
                )
                for p in peers
                for _ in range(250)
            ]
            relay.put(lines)
            total += len(lines) // len(peers)
            if i == 10:
                wait_for(lambda: upstream.connections == 1, what="the relay's connection")
                for conn in list(upstream._conns.values()):  # the network drops the connection
                    conn.sock.shutdown(socket.SHUT_RDWR)
            if i % 10 == 9:
                wait_for(lambda: not relay._queue, 30, "the relay's queue to drain")
        relay.close(timeout=10)
        wait_for(
            lambda: all(p.sent + p.dropped >= total for p in upstream.peers.values()) and len(upstream.peers) == 4,
            30,
            "the relay's final counts",
        )
        upstream.take()
    finally:
        relay.close()
        upstream.close()
    assert relay.connects >= 2
    for peer in upstream.peers.values():
        assert peer.host == "node7"
        assert peer.received + peer.lost + peer.dropped == total, (peer, total)


def test_run_with_metrics_relays_a_real_job_to_the_receiver(tmp_path: Path) -> None:
    """``ddpdoctor run --metrics --endpoint``: a real torchrun job's two ranks reach the receiver
    through the node's relay, every line as the ranks' own files have it."""
    upstream = StreamListener("127.0.0.1", 0)
    try:
        proc = ddpdoctor_run(
            tmp_path,
            torchrun_cmd(str(EXAMPLES / "torchrun_train.py"), "--steps", "6"),
            "--run-dir",
            "local",
            "--metrics",
            "127.0.0.1:0",
            "--endpoint",
            f"127.0.0.1:{upstream.port}",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "this node's ranks for Prometheus on http://127.0.0.1:" in proc.stdout
        assert "this node's ranks: 2 rank streams" in proc.stdout and "0 dropped by the relay" in proc.stdout
        assert "records over 1 connection(s)" in proc.stdout
        wait_for(lambda: all(p.ended for p in upstream.peers.values()) and len(upstream.peers) == 2, 30, "both ends")
        got = upstream.take()
    finally:
        upstream.close()
    for rank in range(2):
        local = (tmp_path / "local" / f"rank-0000{rank}.jsonl").read_bytes()
        streamed = b"".join(line.raw for line in got if line.peer.rank == rank)
        assert streamed == _records_only(local)
    assert sum(p.connections for p in upstream.peers.values()) == 1 and len(upstream.peers) == 2  # one socket
    assert upstream.health().problems() == []


def _records_only(data: bytes) -> bytes:
    """A rank file's record lines (its own index lines are the file's, never streamed)."""
    return b"".join(line + b"\n" for line in data.splitlines() if not line.startswith(b'{"kind":"index"'))
