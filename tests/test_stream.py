"""The live stream on real sockets (127.0.0.1, port 0): TcpSink -> StreamListener / StreamSource,
drops and reconnects, and the listener's defences (token, garbage, oversized lines, connection
count, slow and half-open clients)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpdoctor.cli.ports import free_port
from ddpdoctor.events import End, FindingRecord, ProcSample, Record, StreamDrops, encode
from ddpdoctor.runlog import RankFileTail
from ddpdoctor.runlog.source import RankRecord
from ddpdoctor.sinks import FileSink, MemorySink
from ddpdoctor.sinks.tcp import TcpSink, TeeSink, stream_tee
from ddpdoctor.stream.listener import StreamError, StreamLine, StreamListener
from ddpdoctor.stream.source import StreamSource

TOKEN = "s3cret-token"


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond`` until it holds; the deadline fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout
    done = threading.Event()
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        done.wait(0.02)


def mono(record: Record) -> int:
    """The index a ``proc_record`` carries."""
    assert isinstance(record, ProcSample)
    return record.t_mono_ns


def proc_record(rank: int, i: int) -> ProcSample:
    return ProcSample(rank=rank, t_mono_ns=i, t_wall_ns=i, cpu_pct=1.0, rss_bytes=i)


def hello(rank: int = 0, token: str | None = None, **extra: object) -> bytes:
    msg = {"ddpdoctor": "hello", "v": 1, "token": token, "rank": rank, "ddp": 0, "run": "r", "attempt": None}
    msg.update(extra)
    return json.dumps(msg).encode() + b"\n"


def raw_client(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """True when the listener closed this connection (EOF or reset) within ``timeout``."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def listener() -> Iterator[StreamListener]:
    lis = StreamListener("127.0.0.1", 0)
    yield lis
    lis.close()


def taken(got: list[Any], more: list[Any]) -> list[Any]:
    """``got`` with ``more`` appended (for conditions that gather what arrived)."""
    got.extend(more)
    return got


def collect(lis: StreamListener, n: int, timeout: float = 10.0) -> list[StreamLine]:
    got: list[StreamLine] = []
    wait_for(lambda: len(taken(got, lis.take())) >= n, timeout, f"{n} records")
    return got


def test_records_arrive_with_their_rank_and_exact_bytes(listener: StreamListener) -> None:
    sink = TcpSink(f"127.0.0.1:{listener.port}", rank=3, ddp=1, run="run-x", attempt=2)
    try:
        records = [proc_record(3, i) for i in range(50)]
        for r in records:
            sink.emit(r)
        assert sink.flush(timeout=10)
        got = collect(listener, 50)
    finally:
        sink.close()
    assert [g.record for g in got] == records
    assert [g.raw for g in got] == [encode(r) for r in records]  # what a file sink writes, byte for byte
    peer = got[0].peer
    assert (peer.run, peer.attempt, peer.rank, peer.ddp) == ("run-x", 2, 3, 1)
    assert sink.sent == 50 and sink.dropped == 0 and listener.dropped() == 0


def test_stream_source_is_a_record_source(listener: StreamListener) -> None:
    source = StreamSource("127.0.0.1", 0)
    try:
        assert source.label == f"listening on 127.0.0.1:{source.port}"
        assert source.poll() == []
        sink = TcpSink(f"127.0.0.1:{source.port}", rank=1)
        sink.emit(proc_record(1, 7))
        sink.close()
        out: list[RankRecord] = []
        wait_for(lambda: bool(taken(out, source.poll())))
        assert [(r.rank, r.ddp, r.record) for r in out] == [(1, 0, proc_record(1, 7))]
        health = source.health()  # (the stream closes without an end record: may count as closed early)
        assert (health.corrupt_lines, health.unknown_lines, health.dropped, health.lost, health.refused) == (0,) * 5
    finally:
        source.close()


def test_an_older_elastic_attempt_is_not_mixed_into_the_live_view() -> None:
    source = StreamSource("127.0.0.1", 0)
    try:
        new = TcpSink(f"127.0.0.1:{source.port}", rank=0, run="r", attempt=1)
        new.emit(proc_record(0, 1))
        new.close()
        out: list[RankRecord] = []
        wait_for(lambda: bool(taken(out, source.poll())))
        old = TcpSink(f"127.0.0.1:{source.port}", rank=0, run="r", attempt=0)
        old.emit(proc_record(0, 2))
        old.close()
        wait_for(
            lambda: (
                source.listener.peers.get(("r", 0, 0, 0)) is not None
                and source.listener.peers[("r", 0, 0, 0)].sent == 1
            ),
            what="the old attempt's stats",
        )
        assert [mono(r.record) for r in out + source.poll()] == [1]
    finally:
        source.close()


def test_two_runs_sent_to_one_watcher_are_never_mixed() -> None:
    """The newest run to connect is shown; the other's records are dropped and counted; a rank of
    the older run that reconnects does not move the view back; the view starts afresh on the
    switch (its label names the run)."""
    from ddpdoctor.analysis.live_run import LiveRun, poll_source

    source = StreamSource("127.0.0.1", 0)
    live = LiveRun(label=source.label, attempt=source.attempt)
    try:
        first = TcpSink(f"127.0.0.1:{source.port}", rank=0, run="run-a")
        first.emit(proc_record(0, 1))
        first.flush()
        out: list[RankRecord] = []
        wait_for(lambda: bool(taken(out, source.poll())))
        assert [mono(r.record) for r in out] == [1] and source.run == "run-a"
        assert source.label == f"listening on 127.0.0.1:{source.port}, run run-a"
        live, _ = poll_source(live, source)
        assert live.label == source.label
        second = TcpSink(f"127.0.0.1:{source.port}", rank=0, run="run-b")
        second.emit(proc_record(0, 100))
        second.flush()
        out.clear()
        wait_for(lambda: bool(taken(out, source.poll())))
        assert [mono(r.record) for r in out] == [100] and source.run == "run-b"
        # run-a goes on sending, and one of its ranks connects anew: neither is shown
        first.emit(proc_record(0, 2))
        first.close()
        again = TcpSink(f"127.0.0.1:{source.port}", rank=1, run="run-a")
        again.emit(proc_record(1, 3))
        again.close()
        second.emit(proc_record(0, 101))
        second.close()

        def settled() -> bool:
            taken(out, source.poll())
            return len(out) == 2 and source.ignored == 2

        wait_for(settled, what="run-b's record and run-a's two")
        assert [mono(r.record) for r in out] == [100, 101]
        assert source.run == "run-b" and source.other_runs == 1
        # the LiveRun of run-a is left behind at the switch
        fresh = LiveRun(label="listening on the old label", attempt=source.attempt)
        assert poll_source(fresh, source)[0] is not fresh
    finally:
        source.close()


def test_receiver_down_never_blocks_and_counts_drops_then_reconnects() -> None:
    port = free_port()  # nobody listens here yet
    file = MemorySink()
    tee = stream_tee(file, f"127.0.0.1:{port}", rank=0, run="r")
    tcp = _sender_of(tee)
    tcp.max_pending = 1000
    t0 = time.perf_counter()
    for i in range(5000):
        tee.emit(proc_record(0, i))
    emit_s = time.perf_counter() - t0
    assert emit_s < 1.0  # 5000 emits with the receiver down: microseconds each, no network wait
    assert tcp.dropped == 4000 and len(file.records) == 5000  # the local log has every record
    lis = StreamListener("127.0.0.1", port)
    try:
        got = collect(lis, 1000, timeout=20)  # backoff reconnect, then the queued records
        assert [mono(g.record) for g in got] == list(range(1000))
        wait_for(lambda: lis.dropped() == 4000, what="the sender's drop count to reach the listener")
        tee.close()
        # the local file says how much the stream lost (a stream_drops record: running total)
        notes = [r for r in file.records if isinstance(r, StreamDrops)]
        assert notes and notes[-1].dropped == 4000 and notes[-1].endpoint == f"127.0.0.1:{port}"
        assert tcp.connects == 1
    finally:
        lis.close()


def test_a_receiver_that_goes_away_costs_drops_not_training() -> None:
    lis = StreamListener("127.0.0.1", 0)
    port = lis.port
    tcp = TcpSink(f"127.0.0.1:{port}", rank=0, max_queue=100)
    try:
        tcp.emit(proc_record(0, 0))
        assert tcp.flush(timeout=10)
        lis.close()  # receiver gone
        for i in range(1, 501):
            tcp.emit(proc_record(0, i))
        assert tcp.dropped >= 400  # the queue bound held at once; the rest was counted
        # the kernel may take a few sends before the reset shows: then the sender notices and drops
        deadline = time.monotonic() + 20
        while tcp.flush(timeout=10):
            assert time.monotonic() < deadline, "the sender never noticed the receiver is gone"
            for i in range(100):
                tcp.emit(proc_record(0, i))
        assert tcp.dropped > 400
    finally:
        tcp.close(timeout=5)


# -- security ---------------------------------------------------------------------------------


def test_binding_off_loopback_requires_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDPDOCTOR_TOKEN", raising=False)
    with pytest.raises(StreamError, match="DDPDOCTOR_TOKEN"):
        StreamListener("0.0.0.0", 0)
    with pytest.raises(StreamError):
        StreamSource("", 0)
    monkeypatch.setenv("DDPDOCTOR_TOKEN", TOKEN)
    lis = StreamListener("0.0.0.0", 0)  # the token from the environment
    lis.close()


def test_with_a_token_a_wrong_or_missing_token_is_refused() -> None:
    lis = StreamListener("0.0.0.0", 0, token=TOKEN)
    try:
        for bad in (None, "wrong-token", TOKEN + "x", ""):
            sock = raw_client(lis.port)
            sock.sendall(hello(token=bad) + encode(proc_record(0, 1)))
            assert closed_by_peer(sock), bad
            sock.close()
        assert lis.rejected == 4 and lis.take() == []
        good = TcpSink(f"127.0.0.1:{lis.port}", rank=0, token=TOKEN)
        good.emit(proc_record(0, 2))
        good.close()
        assert [mono(g.record) for g in collect(lis, 1)] == [2]
    finally:
        lis.close()


def test_garbage_is_counted_and_skipped_and_a_bad_hello_is_refused(listener: StreamListener) -> None:
    junk = raw_client(listener.port)
    junk.sendall(b"\x00\xff garbage before any hello\n")
    assert closed_by_peer(junk)
    junk.close()
    sock = raw_client(listener.port)
    try:
        sock.sendall(
            hello()
            + b"not json\n"
            + b"\xde\xad\xbe\xef\n"
            + b'{"kind":"nope","rank":0}\n'
            + b"[[[[[[\n"
            + b'{"ddpdoctor":"stats","dropped":"lots"}\n'
            + encode(proc_record(0, 5))
        )
        got = collect(listener, 1)
    finally:
        sock.close()
    assert [mono(g.record) for g in got] == [5]  # the good line after the garbage still arrives
    # five bad lines, each counted once (JSON of an unknown shape as unknown, the rest as corrupt)
    assert listener.corrupt_lines + listener.unknown_lines == 5 and listener.corrupt_lines >= 3
    assert listener.rejected == 1


def test_an_oversized_line_closes_only_that_connection() -> None:
    lis = StreamListener("127.0.0.1", 0, max_line=1000)
    try:
        good = TcpSink(f"127.0.0.1:{lis.port}", rank=1)
        big = raw_client(lis.port)
        big.sendall(hello(rank=0) + b"x" * 5000)  # no newline in sight
        assert closed_by_peer(big)
        big.close()
        big2 = raw_client(lis.port)
        big2.sendall(hello(rank=2) + b'{"kind":"proc",' + b" " * 2000 + b"}\n")  # a whole line, too long
        assert closed_by_peer(big2)
        big2.close()
        assert lis.oversized == 2
        good.emit(proc_record(1, 1))
        good.close()
        assert [g.peer.rank for g in collect(lis, 1)] == [1]
    finally:
        lis.close()


def test_too_many_connections_are_refused_and_slots_come_back() -> None:
    lis = StreamListener("127.0.0.1", 0, max_connections=3)
    socks = []
    try:
        for rank in range(3):
            s = raw_client(lis.port)
            s.sendall(hello(rank=rank))
            socks.append(s)
        wait_for(lambda: lis.connections == 3)
        extra = raw_client(lis.port)
        assert closed_by_peer(extra)
        extra.close()
        assert lis.refused == 1
        socks.pop().close()
        wait_for(lambda: lis.connections == 2)
        sink = TcpSink(f"127.0.0.1:{lis.port}", rank=9)
        sink.emit(proc_record(9, 1))
        sink.close()
        assert [g.peer.rank for g in collect(lis, 1)] == [9]
    finally:
        for s in socks:
            s.close()
        lis.close()


def test_slow_and_half_open_clients_do_not_stall_others() -> None:
    lis = StreamListener("127.0.0.1", 0, hello_timeout=1.0)
    silent = raw_client(lis.port)  # connects and never says a word (half-open, as far as we can tell)
    partial = raw_client(lis.port)
    partial.sendall(hello(rank=1) + b'{"kind":"proc","rank":1,')  # stops in the middle of a line
    trickle = raw_client(lis.port)
    trickle.sendall(hello(rank=2))
    try:
        sink = TcpSink(f"127.0.0.1:{lis.port}", rank=0)
        line = encode(proc_record(2, 1))
        for i in range(200):
            sink.emit(proc_record(0, i))
            if i < len(line):
                trickle.sendall(line[i : i + 1])  # one byte at a time
        sink.close()
        got = collect(lis, 200)
        assert [mono(g.record) for g in got if g.peer.rank == 0] == list(range(200))
        assert closed_by_peer(silent, timeout=10)  # no hello within hello_timeout: closed
        assert lis.timed_out >= 1
        assert len(line) < 200  # trickled whole, one byte per record of the fast sender
        wait_for(lambda: any(g.peer.rank == 2 for g in taken(got, lis.take())), what="the trickled record")
        partial.close()  # a torn last line is dropped, never passed on
        wait_for(lambda: lis.connections <= 1)
        assert lis.take() == []
    finally:
        for s in (silent, partial, trickle):
            s.close()
        lis.close()


def test_end_record_roundtrip_through_stream_tee(listener: StreamListener) -> None:
    file = MemorySink()
    tee = stream_tee(file, f"127.0.0.1:{listener.port}", rank=0, run="r")
    end = End(rank=0, t_mono_ns=1, t_wall_ns=2, steps=3, reason="close")
    tee.emit(end)
    tee.close()
    assert file.records == [end] and file.closed
    assert [g.record for g in collect(listener, 1)] == [end]


# -- closing and flushing while the receiver is stuck (it accepted, it never reads) -------------


@pytest.fixture
def stuck_receiver() -> Iterator[int]:
    """A port whose listener never accepts nor reads: connects succeed (the kernel's backlog),
    then a sender's ``sendall`` blocks once the small buffers are full."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    try:
        yield srv.getsockname()[1]
    finally:
        srv.close()


def _bulky(i: int) -> FindingRecord:
    return FindingRecord(rank=0, code="x", severity="info", title=str(i), detail="d" * 20_000, fix="")


def _blocked_in_send(sink: TcpSink) -> bool:
    frame = sys._current_frames().get(sink._thread.ident or -1)
    return frame is not None and frame.f_code.co_name == "_sendall"


def _sender_of(tee: object) -> TcpSink:
    assert isinstance(tee, TeeSink) and isinstance(tee.secondary, TcpSink)
    return tee.secondary


def test_close_with_a_stuck_receiver_still_writes_the_final_drop_count(stuck_receiver: int, tmp_path: Path) -> None:
    path = tmp_path / "rank-00000.jsonl"
    tee = stream_tee(FileSink(path), f"127.0.0.1:{stuck_receiver}", rank=0, run="r")
    sender = _sender_of(tee)
    for i in range(1000):  # 20 MB: far more than the socket buffers hold
        tee.emit(_bulky(i))
    wait_for(lambda: _blocked_in_send(sender), what="the sender to block in sendall")
    t0 = time.monotonic()
    tee.close(timeout=5.0)
    took = time.monotonic() - t0
    sender._thread.join(10)
    assert not sender._thread.is_alive()
    assert took < 3.0  # the stream gets its 2 s, the file closes after it
    assert sender.dropped > 0 and sender.sent + sender.dropped == 1000
    tail = RankFileTail(path, 0, 0)
    tail.poll(final=True)
    assert len(tail.log.findings) == 1000  # the local file has every record
    # the final drop count reached the file before it closed, exactly when the receiver is down
    assert tail.log.stream_dropped == sender.dropped


def test_flush_does_not_wait_on_the_network(stuck_receiver: int) -> None:
    file = MemorySink()
    tee = stream_tee(file, f"127.0.0.1:{stuck_receiver}", rank=0, run="r")
    sender = _sender_of(tee)
    try:
        for i in range(1000):
            tee.emit(_bulky(i))
        wait_for(lambda: _blocked_in_send(sender), what="the sender to block in sendall")
        t0 = time.monotonic()
        assert tee.flush(timeout=5.0)  # the local file is flushed
        assert time.monotonic() - t0 < 0.2  # the training thread did not wait for the stuck stream
    finally:
        tee.close(timeout=2.0)


_EMFILE_CHILD = textwrap.dedent("""
    import os, resource, sys, time
    from ddpdoctor.stream.listener import StreamListener

    lis = StreamListener("127.0.0.1", 0)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))  # accept() now fails with EMFILE
    print(lis.port, flush=True)
    sys.stdin.readline()  # the parent's connections wait in the backlog
    t0 = time.process_time()
    time.sleep(1.0)  # a measuring window: the listener thread's CPU time in it
    cpu = time.process_time() - t0
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print(cpu, getattr(lis, "accept_errors", -1), flush=True)
    lis.close()
""")


def test_out_of_file_descriptors_the_listener_pauses_instead_of_spinning() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _EMFILE_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    clients = []
    try:
        assert child.stdout is not None and child.stdin is not None
        port = int(child.stdout.readline())
        clients = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        child.stdin.write("go\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=30)
        cpu, errors = out.split()
        assert int(errors) >= 1  # accept() did run out of descriptors
        assert float(cpu) < 0.3  # and the loop backed off instead of burning a core
    finally:
        for c in clients:
            c.close()
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_tee_emit_many_reaches_the_primary_whatever_the_copy_does() -> None:
    """The batched emission through a tee: the primary (the local file's place) gets every
    record in order; a copy that raises costs it nothing."""

    class Broken(MemorySink):
        def emit_many(self, records: Any) -> None:
            raise OSError("the stream is gone")

    primary, copy = MemorySink(), MemorySink()
    TeeSink(primary, copy).emit_many([_bulky(0), _bulky(1)])
    assert [r.title for r in primary.records] == ["0", "1"] and len(copy.records) == 2
    failing = MemorySink()
    TeeSink(failing, Broken()).emit_many([_bulky(2)])
    assert [r.title for r in failing.records] == ["2"]
