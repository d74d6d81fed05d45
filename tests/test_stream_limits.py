"""The receiver at scale: nothing it refuses or loses goes uncounted, and one listener takes a
2,048-rank job's direct connections."""

from __future__ import annotations

import json
import resource
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ddpdoctor
from ddpdoctor.events import End, encode
from ddpdoctor.events.wire import encode_stats
from ddpdoctor.stream.listener import FD_RESERVE, StreamListener
from ddpdoctor.stream.source import StreamSource
from tests.test_stream import closed_by_peer, collect, hello, proc_record, raw_client, wait_for


def test_a_receiver_over_its_connection_limit_counts_and_shows_the_refusals() -> None:
    lis = StreamListener("127.0.0.1", 0, max_connections=3)
    socks = []
    try:
        for rank in range(3):
            s = raw_client(lis.port)
            s.sendall(hello(rank=rank))
            socks.append(s)
        wait_for(lambda: lis.connections == 3, what="three streams")
        for _ in range(2):
            extra = raw_client(lis.port)
            assert closed_by_peer(extra)
            extra.close()
        health = lis.health()
        assert health.refused == 2
        assert "2 connections refused" in health.problems()
        assert "connections refused over the limit of 3: 2" in lis.summary()
    finally:
        for s in socks:
            s.close()
        lis.close()


def test_records_lost_with_a_broken_connection_are_counted() -> None:
    """A sender's stats say how many records it sent: what never arrived is counted as lost, and
    a stream that closed before its rank's end record is counted too."""
    lis = StreamListener("127.0.0.1", 0)
    try:
        first = raw_client(lis.port)
        first.sendall(hello(rank=4, pid=77) + encode_stats(0, 0))
        first.sendall(b"".join(encode(proc_record(4, i)) for i in range(2)))
        collect(lis, 2)
        first.close()  # the sender thought it sent 5: 3 were in flight when the connection broke
        wait_for(lambda: lis.closed_early == 1, what="the close")
        second = raw_client(lis.port)
        second.sendall(hello(rank=4, pid=77) + encode_stats(5, 0) + encode(proc_record(4, 9)))
        second.sendall(encode(End(rank=4, t_mono_ns=1, t_wall_ns=1, steps=0, reason="close")) + encode_stats(7, 0))
        collect(lis, 2)
        wait_for(lambda: lis.peers[("r", None, 4, 0)].sent == 7, what="the last stats")
        second.close()
        health = lis.health()
        assert health.lost == 3
        assert health.closed == 1  # the second stream ended after the rank's end record: not early
        assert "3 lost in transit" in health.problems()
        assert "1 streams closed early" in health.problems()
    finally:
        lis.close()


def test_a_new_process_of_a_rank_is_not_a_loss() -> None:
    """A rank restarted (another pid) counts its records from 0 again: nothing was lost."""
    lis = StreamListener("127.0.0.1", 0)
    try:
        for pid, sent in ((10, 0), (10, 1), (11, 0), (11, 1)):
            s = raw_client(lis.port)
            s.sendall(hello(rank=0, pid=pid) + encode_stats(sent, 0) + encode(proc_record(0, sent)))
            s.sendall(encode_stats(sent + 1, 0))
            collect(lis, 1)
            wait_for(lambda sent=sent: lis.peers[("r", None, 0, 0)].sent == sent + 1, what="stats")  # type: ignore[misc]
            s.close()
        assert lis.lost() == 0
    finally:
        lis.close()


def test_the_stream_source_health_carries_the_receiver_counts() -> None:
    source = StreamSource("127.0.0.1", 0)
    try:
        source.listener.max_connections = 0
        extra = raw_client(source.port)
        assert closed_by_peer(extra)
        extra.close()
        assert source.health().refused == 1
    finally:
        source.close()


_WIDE_CHILD = textwrap.dedent("""
    import json, socket, sys, time
    from ddpdoctor.stream.listener import StreamListener
    from ddpdoctor.events import ProcSample, encode
    from ddpdoctor.events.wire import Hello, encode_hello

    ranks = int(sys.argv[1])
    lis = StreamListener("127.0.0.1", 0)  # raises this process's open-files limit first
    clients = []
    for rank in range(ranks):
        s = socket.create_connection(("127.0.0.1", lis.port), timeout=30)
        s.sendall(encode_hello(Hello(rank=rank, run="wide", pid=rank + 1)))
        s.sendall(encode(ProcSample(rank=rank, t_mono_ns=1, t_wall_ns=1, cpu_pct=0.0, rss_bytes=1)))
        clients.append(s)
    got, deadline = 0, time.monotonic() + 60
    while got < ranks and time.monotonic() < deadline:
        got += len(lis.take())
        time.sleep(0.05)
    print(json.dumps({"got": got, "peers": len(lis.peers), "refused": lis.refused,
                      "limit": lis.max_connections, "problems": lis.health().problems()}))
    for s in clients:
        s.close()
    lis.close()
""")


def test_one_listener_takes_2048_direct_connections() -> None:
    """A job of 2,048 ranks streaming one connection each: every rank arrives, none refused (the
    listener raised its own open-files limit; the job's half was lost at 512 before)."""
    ranks = 2048
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2 * ranks + FD_RESERVE + 64:
        pytest.skip(f"the hard open-files limit ({hard}) is below what both ends of {ranks} connections need")
    child = subprocess.run(
        [sys.executable, "-c", _WIDE_CHILD, str(ranks)], capture_output=True, text=True, timeout=180, check=False
    )
    assert child.returncode == 0, child.stderr[-2000:]
    got = json.loads(child.stdout)
    assert got["limit"] >= ranks
    assert (got["got"], got["peers"], got["refused"], got["problems"]) == (ranks, ranks, 0, [])


def test_collect_says_what_it_refused_and_the_report_reads_it(tmp_path: Path) -> None:
    """``collect`` over its limit: the summary names the refusals, ``receiver.json`` keeps them,
    and ``load_run`` reads them back for the report."""
    out_dir = tmp_path / "collected"
    collector = subprocess.Popen(
        [sys.executable, "-m", "ddpdoctor", "collect", "--listen", "127.0.0.1:0", "--run-dir", str(out_dir)]
        + ["--max-connections", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    socks: list[socket.socket] = []
    try:
        assert collector.stdout is not None
        first = collector.stdout.readline()
        port = int(first.split("listening on 127.0.0.1:")[1].split(",")[0])
        for rank in range(2):
            s = raw_client(port)
            s.sendall(hello(rank=rank) + encode(proc_record(rank, 1)))
            socks.append(s)
        wait_for(lambda: len(list(out_dir.glob("rank-*.jsonl"))) == 2, 20, "two rank files")
        refused = raw_client(port)
        assert closed_by_peer(refused)
        refused.close()
        collector.send_signal(signal.SIGINT)
        out, err = collector.communicate(timeout=30)
        assert collector.returncode == 0, err
    finally:
        for s in socks:
            s.close()
        if collector.poll() is None:
            collector.kill()
            collector.wait(timeout=30)
    assert "connections refused over the limit of 2: 1" in out
    assert "warning: the stream is incomplete" in out and "1 connections refused" in out
    run = ddpdoctor.load_run(out_dir)
    assert run.receiver is not None and run.receiver.refused == 1
    report = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "report", str(out_dir)], capture_output=True, text=True, timeout=120
    )
    assert "did not get everything: 1 connections refused" in report.stdout, report.stdout + report.stderr
