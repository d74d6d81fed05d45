"""Flush every live monitor at interpreter exit and on SIGTERM, without delaying the exit.

A Python-level SIGTERM handler only runs when the main thread returns to the interpreter; a
rank blocked inside a collective (the very hang ddpdoctor diagnoses) would then ignore SIGTERM.
So the handler is backed by a wakeup fd read on a daemon thread: that thread flushes at once
if the main thread has not run the handler within a moment (it is blocked), flushes and, if
the process had the default disposition, restores the default disposition and re-raises SIGTERM itself. The process dies
from SIGTERM exactly as it would have without ddpdoctor, only with its log flushed.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import threading
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpdoctor.runtime.monitor import Monitor

GRACE_S = 2.0
#: How long the main thread gets to run the Python-level handler before the watcher acts.
MAIN_THREAD_WAIT_S = 0.3
_monitors: weakref.WeakSet[Monitor] = weakref.WeakSet()
_lock = threading.Lock()
_installed = False
_previous: Any = signal.SIG_DFL
_handled = threading.Event()


def register(monitor: Monitor) -> None:
    """Have ``monitor`` closed at exit and on SIGTERM."""
    global _installed
    with _lock:
        _monitors.add(monitor)
        if _installed:
            return
        _installed = True
    atexit.register(close_all, "exit")
    if threading.current_thread() is threading.main_thread():
        _install_sigterm()


def close_all(reason: str) -> None:
    """Close every live monitor (flushing its sink) with ``reason`` in its End record."""
    for monitor in list(_monitors):
        try:
            monitor.close(reason=reason, timeout=GRACE_S)
        except Exception:
            pass


def _install_sigterm() -> None:
    global _previous
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN or previous is None:
        return  # ignored, or set from C: not ours to touch
    _previous = previous
    signal.signal(signal.SIGTERM, _on_sigterm)
    if previous is signal.SIG_DFL:
        _start_wakeup_watcher()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _handled.set()
    close_all("signal")
    if callable(_previous):
        _previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _start_wakeup_watcher() -> None:
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        old = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):
        return
    if old != -1:  # someone (an event loop) owns the wakeup fd: leave it to them
        signal.set_wakeup_fd(old)
        reader.close()
        writer.close()
        return
    _keep_alive.extend((reader, writer))
    threading.Thread(target=_watch, args=(reader,), name="ddpdoctor-sigterm", daemon=True).start()


_keep_alive: list[socket.socket] = []


def _watch(reader: socket.socket) -> None:
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM not in data:
            continue
        if _handled.wait(MAIN_THREAD_WAIT_S):
            return  # the main thread's handler runs: it flushes and re-raises
        # The main thread is stuck in native code: flush from here, then die by SIGTERM as the
        # process would have without ddpdoctor.
        close_all("signal")
        libc = ctypes.CDLL(None)
        libc.signal(int(signal.SIGTERM), 0)  # SIG_DFL, settable from any thread at the C level
        os.kill(os.getpid(), signal.SIGTERM)
