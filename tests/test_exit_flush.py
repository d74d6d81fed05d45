"""SIGTERM flushes the log and the process still dies by SIGTERM, even blocked in a collective."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ddpdoctor.analysis.live_view import end_text
from ddpdoctor.events import End
from ddpdoctor.runlog import RankFileTail
from tests.ddp_harness import free_port

SCRIPT = Path(__file__).parent / "scripts" / "train_until_killed.py"


def _start(rank: int, world: int, port: int, run_dir: Path, stall_after: int = -1) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=str(port), STALL_AFTER=str(stall_after))
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(run_dir)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def _wait_for_steps(tail: RankFileTail, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(tail.log.steps) < n:
        assert time.monotonic() < deadline, f"only {len(tail.log.steps)} steps logged after {timeout} s"
        tail.poll()
        time.sleep(0.05)  # polling a file with a deadline


def _wait_until_main_thread_sleeps(pid: int, timeout: float) -> None:
    """Poll /proc until the main thread has been asleep (blocked) for 20 consecutive reads."""
    deadline = time.monotonic() + timeout
    asleep = 0
    while asleep < 20:
        assert time.monotonic() < deadline, "rank 0 never blocked"
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
        state = stat.rsplit(")", 1)[1].split()[0]
        asleep = asleep + 1 if state == "S" else 0
        time.sleep(0.01)


def test_sigterm_flushes_and_the_process_dies_by_sigterm(tmp_path: Path) -> None:
    proc = _start(0, 1, free_port(), tmp_path)
    try:
        tail = RankFileTail(tmp_path / "rank-00000.jsonl", 0, 0)
        _wait_for_steps(tail, 3, timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        tail.poll(final=True)
        assert isinstance(tail.log.end, End) and tail.log.end.reason == "signal"
        assert tail.log.end.signal == "SIGTERM" and end_text(tail.log.end) == "signal: SIGTERM"
        assert tail.log.end.steps == len(tail.log.steps) >= 3
        assert tail.log.corrupt_lines == 0
    finally:
        proc.kill()
        proc.wait(10)


def test_sigterm_while_blocked_in_a_collective_still_flushes_and_kills(tmp_path: Path) -> None:
    port = free_port()
    procs = [_start(r, 2, port, tmp_path, stall_after=3) for r in range(2)]
    try:
        tail = RankFileTail(tmp_path / "rank-00000.jsonl", 0, 0)
        # step 2's record is written when step 3 starts: rank 0 then blocks in step 3's collectives
        _wait_for_steps(tail, 3, timeout=60)
        _wait_until_main_thread_sleeps(procs[0].pid, timeout=30)
        start = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=30) == -signal.SIGTERM
        assert time.monotonic() - start < 15
        tail.poll(final=True)
        assert isinstance(tail.log.end, End) and tail.log.end.reason == "signal"
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_report_works_on_a_run_still_being_written(tmp_path: Path, capsys: object) -> None:
    import json

    from ddpdoctor.cli.main import main

    proc = _start(0, 1, free_port(), tmp_path)
    try:
        tail = RankFileTail(tmp_path / "rank-00000.jsonl", 0, 0)
        _wait_for_steps(tail, 5, timeout=60)
        out = tmp_path / "live.json"
        assert main(["report", str(tmp_path), "--format", "json", "-o", str(out)]) == 0
        report = json.loads(out.read_text())
        assert proc.poll() is None  # the job is still training while the report is made
        assert report["ranks"][0]["status"] == "running" and report["ranks"][0]["steps"] >= 5
        assert report["run"]["finished"] is False and report["run"]["corrupt_lines"] == 0
    finally:
        proc.kill()
        proc.wait(10)


def test_a_close_that_fails_at_exit_is_said_on_stderr(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        import ddpdoctor
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        dist.init_process_group("gloo", rank=0, world_size=1)
        ddp = DDP(torch.nn.Linear(4, 4))
        monitor = ddpdoctor.instrument(ddp, run_dir={str(tmp_path)!r})
        ddp(torch.randn(2, 4)).sum().backward()
        def broken_close(reason="close", timeout=5.0):
            raise OSError("disk gone")
        monitor.close = broken_close
        print("trained", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert "trained" in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode == 0
    assert "closing a log at exit failed (OSError: disk gone)" in proc.stderr
    assert "LogWriteWarning" in proc.stderr


def _exit_with(tmp_path: Path, ending: str, before: str = "") -> tuple[subprocess.CompletedProcess[str], End | None]:
    """A one-rank job that runs ``before`` (one line of Python source), trains a step, then ends
    with ``ending`` (Python source)."""
    code = (
        textwrap.dedent(f"""
        import os, sys, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        import ddpdoctor
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        dist.init_process_group("gloo", rank=0, world_size=1)
        {before}
        ddp = DDP(torch.nn.Linear(4, 4))
        monitor = ddpdoctor.instrument(ddp, run_dir={str(tmp_path)!r})
        ddp(torch.randn(2, 4)).sum().backward()
        print("trained", flush=True)
    """)
        + ending
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    tail = RankFileTail(tmp_path / "rank-00000.jsonl", 0, 0)
    tail.poll(final=True)
    return proc, tail.log.end


def test_an_uncaught_exception_ends_the_log_as_failed_and_the_process_as_it_would(tmp_path: Path) -> None:
    import ddpdoctor

    proc, end = _exit_with(tmp_path, 'raise RuntimeError("out of data")\n')
    assert "trained" in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode == 1 and "RuntimeError: out of data" in proc.stderr
    assert end is not None and end.reason == "error: RuntimeError"
    from ddpdoctor.cli.render_text import render

    report = ddpdoctor.analyze(ddpdoctor.load_run(tmp_path))
    assert report.ranks[0]["status"] == "failed"
    assert "1 steps, ended, rank 0 failed (an exception ended training)" in render(report)


def test_sys_exit_and_a_keyboard_interrupt_end_the_log_as_before(tmp_path: Path) -> None:
    proc, end = _exit_with(tmp_path / "exit", "sys.exit(3)\n")
    assert proc.returncode == 3 and end is not None and end.reason == "exit"
    proc, end = _exit_with(tmp_path / "interrupt", "raise KeyboardInterrupt\n")
    assert proc.returncode != 0 and end is not None and end.reason == "signal"


_HANDLED = """
import signal
caught = []
signal.signal(signal.SIG{name}, lambda signum, frame: caught.append(signum))
os.kill(os.getpid(), signal.SIG{name})
while not caught:  # the handler runs between two bytecodes of this thread
    pass
sys.exit(0)
"""


def test_a_stop_signal_the_jobs_own_handler_caught_is_named_at_the_end(tmp_path: Path) -> None:
    import ddpdoctor
    from ddpdoctor.cli.render_text import render

    # a preemption: the job's handler (installed after instrument, over ddpdoctor's) catches
    # SIGTERM and the job exits cleanly, exit code 0: the log names the signal
    proc, end = _exit_with(tmp_path / "term", _HANDLED.format(name="TERM"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert end is not None and end.reason == "exit" and end.signal == "SIGTERM"
    assert end_text(end) == "exit after SIGTERM"  # (the live view's rank detail)
    report = ddpdoctor.analyze(ddpdoctor.load_run(tmp_path / "term"))
    assert report.ranks[0]["status"] == "terminated" and report.ranks[0]["end_signal"] == "SIGTERM"
    assert "1 steps, ended by a signal (rank 0 caught SIGTERM in the job's own handler and exited)" in render(report)
    # a handler that raises (as a framework's may): failed, and the signal before it said
    raising = "import signal\nsignal.signal(signal.SIGTERM, lambda s, f: exec('raise RuntimeError(\"preempted\")'))\n"
    proc, end = _exit_with(tmp_path / "raise", raising + "os.kill(os.getpid(), signal.SIGTERM)\n")
    assert proc.returncode == 1 and end is not None and end.reason == "error: RuntimeError" and end.signal == "SIGTERM"
    report = ddpdoctor.analyze(ddpdoctor.load_run(tmp_path / "raise"))
    assert "ended, rank 0 failed (an exception ended training, after SIGTERM)" in render(report)
    # a signal that does not ask the process to stop is no end of it
    proc, end = _exit_with(tmp_path / "usr1", _HANDLED.format(name="USR1"))
    assert proc.returncode == 0 and end is not None and end.reason == "exit" and end.signal == ""
    assert end_text(end) == "exit"
    report = ddpdoctor.analyze(ddpdoctor.load_run(tmp_path / "usr1"))
    assert report.ranks[0]["status"] == "finished" and "1 steps, finished" in render(report)


_TAKEN_NOT_NOTED = """
import signal, threading, time
from ddpdoctor.runtime.process import exit_flush
taken = threading.Event()
note = exit_flush.ExitFlush._note
def late_note(self, data):
    if threading.current_thread().name == "ddpdoctor-sigterm":
        taken.set()
        time.sleep(1.0)  # the watcher thread descheduled between its read and its note
    note(self, data)
exit_flush.ExitFlush._note = late_note
signal.signal(signal.SIGTERM, lambda signum, frame: None)
os.kill(os.getpid(), signal.SIGTERM)
assert taken.wait(30)  # the watcher has the byte: the exit's own read finds the socket empty
sys.exit(0)
"""


def test_a_signal_the_watcher_took_but_had_not_noted_at_exit_is_still_named(tmp_path: Path) -> None:
    # what a loaded machine did 5 times in 300 exits: the exit waits for the watcher's note
    proc, end = _exit_with(tmp_path, _TAKEN_NOT_NOTED)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert end is not None and end.reason == "exit" and end.signal == "SIGTERM"


#: The watcher thread held back until the job has closed its log (the process then exits).
_WATCHER_LATE = (
    "import threading; from ddpdoctor.runtime.process import exit_flush; "
    "late = threading.Event(); watch = exit_flush.ExitFlush._watch; "
    "exit_flush.ExitFlush._watch = lambda self, reader: (late.wait(30), watch(self, reader))"
)

_CLOSED_AFTER_CATCHING = """
import signal
caught = []
signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
os.kill(os.getpid(), signal.SIGINT)
while not caught:  # the handler runs between two bytecodes of this thread
    pass
monitor.close()  # as destroy_process_group does under ddpdoctor run, before the exit
late.set()
sys.exit(0)
"""


def test_a_signal_caught_before_a_close_the_watcher_had_not_read_is_named(tmp_path: Path) -> None:
    # a preempted job that closes its log (destroy_process_group) before the watcher thread got
    # the CPU to read the signal's byte: the close reads it itself
    proc, end = _exit_with(tmp_path, _CLOSED_AFTER_CATCHING, before=_WATCHER_LATE)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert end is not None and end.reason == "close" and end.signal == "SIGINT", end


def test_an_exception_stored_before_monitoring_began_is_not_this_exit(tmp_path: Path) -> None:
    # what an interactive session's earlier traceback, or a test runner's failed test, leaves
    stale = "sys.last_value = ValueError('an earlier cell'); sys.last_type = ValueError"
    proc, end = _exit_with(tmp_path / "clean", "", before=stale)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert end is not None and end.reason == "exit"
    proc, end = _exit_with(tmp_path / "crash", 'raise RuntimeError("out of data")\n', before=stale)
    assert proc.returncode == 1 and end is not None and end.reason == "error: RuntimeError"


def test_the_report_names_the_rank_whose_exception_came_first(tmp_path: Path) -> None:
    """Rank 1 raises; rank 0 then fails in the all-reduce it waits in (its peer is gone). Both
    logs end as failed, and the report says rank 1 failed first."""
    code = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        import ddpdoctor
        dist.init_process_group("gloo")
        ddp = DDP(torch.nn.Linear(4, 4))
        ddpdoctor.instrument(ddp, run_dir={str(tmp_path)!r})
        for step in range(1000):
            if dist.get_rank() == 1 and step == 3:
                raise RuntimeError("rank 1's own error")
            ddp(torch.randn(2, 4)).sum().backward()
    """)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for r in (0, 1)
    ]
    try:
        codes = [p.wait(timeout=120) for p in procs]
        assert codes == [1, 1], [p.stderr.read()[-1500:] if p.stderr else b"" for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    import ddpdoctor
    from ddpdoctor.cli.render_text import render

    report = ddpdoctor.analyze(ddpdoctor.load_run(tmp_path))
    assert [r["status"] for r in report.ranks] == ["failed", "failed"]
    assert report.run["first_failed"] == {"rank": 1, "reason": "error: RuntimeError"}
    assert "ranks 0, 1 failed (an exception ended training; rank 1 first: error: RuntimeError)" in render(report)


FORKING = textwrap.dedent("""
    import signal, sys, time, multiprocessing as mp, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ddpdoctor
    dist.init_process_group("gloo", rank=0, world_size=1)
    ddp = DDP(torch.nn.Linear(4, 4))
    ddpdoctor.instrument(ddp, run_dir=sys.argv[1])

    def train(n):
        for _ in range(n):
            ddp(torch.randn(2, 4)).sum().backward()

    def child_state(_):
        return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.set_wakeup_fd(-1)

    train(3)
    pool = mp.get_context("fork").Pool(2)
    print("child", pool.map(child_state, range(2)), flush=True)
    pool.apply_async(time.sleep, (60,))
    pool.terminate()  # SIGTERM to its workers
    pool.join()
    train(3)
    print("trained on", flush=True)
""")


def test_a_pool_worker_terminated_leaves_the_rank_running(tmp_path: Path) -> None:
    """``Pool.terminate`` SIGTERMs its forked workers: the rank trains on, as without ddpdoctor
    (the workers' signal wakeups went to the socket of the rank's watcher thread, which took them
    for the rank's own SIGTERM and killed it)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(
        [sys.executable, "-c", FORKING, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    kinds = [line.split('"kind":"', 1)[1].split('"', 1)[0] for line in (tmp_path / "rank-00000.jsonl").open()]
    assert proc.returncode == 0 and "trained on" in proc.stdout, proc.stderr[-2000:]
    assert "child [(True, -1), (True, -1)]" in proc.stdout  # SIGTERM's default, no wakeup fd
    assert kinds.count("end") == 1


def test_a_sigint_names_the_end_only_when_the_end_follows_it() -> None:
    from ddpdoctor.runtime.process.exit_flush import SIGINT_END_S, ExitFlush

    flush = ExitFlush()
    assert flush.stop_signal == ""
    flush._note(bytes([signal.SIGUSR1, signal.SIGINT]))
    assert flush.stop_signal == "SIGINT"
    # a notebook's interrupted cell, then training for longer: the end is not the SIGINT's
    flush._stop_at -= SIGINT_END_S + 1
    assert flush.stop_signal == ""
    # a SIGTERM asks the process to stop however long its handler takes
    flush._note(bytes([signal.SIGTERM]))
    flush._stop_at -= 10 * SIGINT_END_S
    assert flush.stop_signal == "SIGTERM"
    flush._note(bytes([signal.SIGINT]))  # (a Ctrl-C in the grace period: the SIGTERM stays)
    flush._stop_at -= 10 * SIGINT_END_S
    assert flush.stop_signal == "SIGTERM"
