"""Logs complete at the end of a process, without changing how the process reacts to signals.

The contract: a signal does to the process exactly what it does without ddpdoctor.

- At interpreter exit every live monitor is closed (``End`` record, reason ``exit``; ``error:
  NAME`` where an uncaught exception ended the main thread, ``signal`` for a KeyboardInterrupt:
  read from what the interpreter records of it, ``sys.last_value``, with no hook of ours; one
  stored there before monitoring began is not counted).
- SIGTERM with the *default* disposition (the process dies): ddpdoctor installs a handler that
  closes every monitor (reason ``signal``), restores the default and re-raises SIGTERM, so the
  process still dies by SIGTERM, with its log complete.
- A user's handler, installed before ``instrument`` or after it, runs exactly as it would
  without ddpdoctor: ddpdoctor installs nothing over it, and if it replaces ddpdoctor's, ours is
  gone. ddpdoctor only *flushes* when SIGTERM arrives (from a thread), so a job that trains
  through its grace period stays monitored; it closes at exit as usual. A handler that chains to
  ``signal.getsignal`` read while ddpdoctor's was installed calls ours: it then only flushes,
  since without ddpdoctor that handler would have seen ``SIG_DFL`` and not died there.
- A Python handler runs only when the main thread returns to the interpreter: a rank blocked in a
  collective (the hang ddpdoctor diagnoses) would never run it. A daemon thread reads the
  signal wakeup fd and flushes at once; if ddpdoctor's own handler is still the installed one
  (``signal.getsignal`` at that moment) and has not run within ``MAIN_THREAD_WAIT_S``, it closes,
  restores ``SIG_DFL`` at the C level and re-raises: the process dies as it would have.
- SIGINT, SIGUSR1 and every other signal are never touched.
- The watcher also notes a SIGTERM or SIGINT that a handler caught (``stop_signal``), so that a
  job whose own handler answers a preemption by saving and exiting cleanly ends its log with
  that signal named (``End.signal``), not as a run that finished. A SIGINT counts only where
  the log ends within ``SIGINT_END_S`` of it: in a notebook or a REPL it interrupts a cell, and
  training may go on for hours after.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import select
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from ddpdoctor.categories import LogWriteWarning, warn

if TYPE_CHECKING:
    from ddpdoctor.runtime.protocols import Closable

GRACE_S = 2.0

#: How long the main thread gets to run ddpdoctor's handler before the watcher acts.
MAIN_THREAD_WAIT_S = 0.3

#: The signals that ask a process to stop: one caught by a handler is named in the End record.
STOP_SIGNALS = {int(signal.SIGTERM): "SIGTERM", int(signal.SIGINT): "SIGINT"}

#: How soon after a SIGINT the log must end for the SIGINT to be named as its end.
SIGINT_END_S = 60.0


def last_exception() -> BaseException | None:
    """The exception the interpreter last stored as uncaught (``sys.last_exc`` from 3.12,
    ``sys.last_value`` before), if any."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def exit_reason(stale: int | None = None) -> str:
    """Why the interpreter exits, for the End record: ``exit``, or ``error: NAME`` where an
    uncaught exception ended the main thread (the interpreter stores it in ``sys.last_value``,
    ``sys.last_exc`` from 3.12, before it prints it and exits; ``sys.exit`` stores nothing), or
    ``signal`` for a KeyboardInterrupt (SIGINT).

    ``stale``: the ``id`` of the exception stored there before monitoring began (an interactive
    session's earlier traceback, a test runner's failed test), which says nothing of this exit."""
    exc = last_exception()
    if exc is None or id(exc) == stale:
        return "exit"
    if isinstance(exc, KeyboardInterrupt):
        return "signal"
    return f"error: {type(exc).__name__}"


class ExitFlush:
    """Closes registered monitors at exit and flushes them on SIGTERM (one per process)."""

    def __init__(self) -> None:
        self._monitors: weakref.WeakSet[Closable] = weakref.WeakSet()
        self._lock = threading.Lock()
        #: held while a byte read off the wakeup fd is not yet noted: the exit's last read then
        #: either finds the byte or finds it noted (``_note_unread_signals``); reentrant, since a
        #: signal handler that closes the monitors may run on a thread that holds it
        self._read_lock = threading.RLock()
        self._installed = False
        self._handled = threading.Event()
        self._handler_installed = False
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        #: ``id`` of the uncaught exception already stored when monitoring began (``exit_reason``)
        self._stale: int | None = None
        #: the last stop signal (``STOP_SIGNALS``) a handler of this process caught while a
        #: monitor was registered, "" where none (or where the wakeup fd is another's), and when
        #: (monotonic seconds)
        self._stop_signal = ""
        self._stop_at = 0.0

    def register(self, monitor: Closable) -> None:
        """Have ``monitor`` closed at exit and flushed on SIGTERM."""
        with self._lock:
            self._monitors.add(monitor)
            if self._installed:
                return
            self._installed = True
            stale = last_exception()
            self._stale = None if stale is None else id(stale)
        atexit.unregister(self._at_exit)  # (a forked child inherits the parent's registration)
        atexit.register(self._at_exit)
        if threading.current_thread() is threading.main_thread():
            self._install_sigterm()

    def unregister(self, monitor: Closable) -> None:
        self._monitors.discard(monitor)

    def _at_exit(self) -> None:
        self._note_unread_signals()
        self.close_all(exit_reason(self._stale))

    def _note_unread_signals(self) -> None:
        """Note a stop signal still unread on the wakeup fd (a handler that exits at once may
        end the process before the watcher thread runs): read without waiting."""
        wakeup = self._wakeup
        if wakeup is None:
            return
        with self._read_lock:
            try:
                data = wakeup[0].recv(64, socket.MSG_DONTWAIT)
            except OSError:  # (nothing there: BlockingIOError)
                return
            self._note(data)

    def _note(self, data: bytes) -> None:
        for signum in data:
            name = STOP_SIGNALS.get(signum)
            # a SIGTERM stays named: a SIGINT after it (a user's Ctrl-C in the grace period) does
            # not make it less of an end
            if name is not None and (name == "SIGTERM" or self._stop_signal != "SIGTERM"):
                self._stop_signal, self._stop_at = name, time.monotonic()

    @property
    def stop_signal(self) -> str:
        """The stop signal to name in an End record written now: the last SIGTERM a handler of
        this process caught, or a SIGINT caught within ``SIGINT_END_S``; "" where none."""
        # a log closed before the exit (destroy_process_group, close) may come before the watcher
        # thread has read the signal's byte on a loaded machine: read what is there first
        self._note_unread_signals()
        if self._stop_signal == "SIGINT" and time.monotonic() - self._stop_at > SIGINT_END_S:
            return ""
        return self._stop_signal

    def close_all(self, reason: str) -> None:
        """Close every live monitor (flushing its sink) with ``reason`` in its End record.

        A close that fails is said on stderr (a ``LogWriteWarning``): the log then lacks its end.
        """
        for monitor in list(self._monitors):
            try:
                monitor.close(reason=reason, timeout=GRACE_S)
            except BaseException as exc:  # noqa: BLE001 - at exit or in a signal handler: say it, never raise
                _say(
                    f"ddpdoctor: closing a log at {reason} failed ({type(exc).__name__}: {exc}); "
                    "the log may end without its end record"
                )

    def flush_all(self) -> None:
        """Flush every live monitor's sink (any thread); nothing is closed."""
        for monitor in list(self._monitors):
            try:
                if not monitor.closed:
                    monitor.flush(timeout=GRACE_S)
            except BaseException as exc:  # noqa: BLE001 - on SIGTERM: say it, never raise
                _say(f"ddpdoctor: flushing a log on SIGTERM failed ({type(exc).__name__}: {exc})")

    # -- SIGTERM -------------------------------------------------------------------------

    def _install_sigterm(self) -> None:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            # only over the default disposition: a user's handler (or SIG_IGN, or one set from C)
            # decides what SIGTERM does, and ddpdoctor only flushes beside it
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._handler_installed = True
        self._start_wakeup_watcher()

    def owns_sigterm(self) -> bool:
        """ddpdoctor's handler is the one installed right now."""
        return self._handler_installed and signal.getsignal(signal.SIGTERM) == self._on_sigterm

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if not self.owns_sigterm():
            # called by a handler installed after ours that chains to it: without ddpdoctor that
            # handler would have found SIG_DFL and not called anything, so the process goes on
            self.flush_all()
            return
        self._handled.set()
        self._note(bytes([int(signal.SIGTERM)]))
        self.close_all("signal")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _start_wakeup_watcher(self) -> None:
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        try:
            old = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            reader.close()
            writer.close()
            return
        if old != -1:  # someone (an event loop) owns the wakeup fd: leave it to them
            signal.set_wakeup_fd(old)
            reader.close()
            writer.close()
            return
        self._wakeup = (reader, writer)
        threading.Thread(target=self._watch, args=(reader,), name="ddpdoctor-sigterm", daemon=True).start()

    def _watch(self, reader: socket.socket) -> None:
        wait: Callable[[], object]
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(reader, select.POLLIN)
            wait = poller.poll
        else:  # (a platform without poll())
            wait = functools.partial(select.select, [reader], [], [])
        while True:
            # wait without reading, then read and note under the read lock: a byte this thread
            # took is noted before the exit's last read can miss it
            try:
                wait()
            except (OSError, ValueError):
                return
            with self._read_lock:
                try:
                    data = reader.recv(64, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue  # the exit read it first
                except OSError:
                    return
                if not data:
                    return
                self._note(data)
            if signal.SIGTERM not in data:
                continue
            if not self.owns_sigterm():
                self.flush_all()  # the user's handler decides; the log is on disk meanwhile
                continue
            if self._handled.wait(MAIN_THREAD_WAIT_S) or not self.owns_sigterm():
                continue  # ours ran on the main thread (the process is on its way out), or a user's took over
            # The main thread is stuck in native code: close from here, then die by SIGTERM as the
            # process would have without ddpdoctor.
            self.close_all("signal")
            libc = ctypes.CDLL(None)
            libc.signal(int(signal.SIGTERM), 0)  # SIG_DFL, settable from any thread at the C level
            os.kill(os.getpid(), signal.SIGTERM)

    def forked(self) -> None:
        """In a forked child (a DataLoader's or a Pool's worker): it closes and flushes none of
        the parent's logs, and its signals are as they would be without ddpdoctor. ddpdoctor's
        SIGTERM handler gives way to the default it replaced, and the wakeup fd, whose socket the
        fork shares with the parent, is let go: a worker's SIGTERM (``Pool.terminate``) written
        there would read, in the parent's watcher thread, as the parent's own, which it then
        closed and killed."""
        self._lock = threading.Lock()  # (a thread of the parent may have held it at the fork)
        self._read_lock = threading.RLock()
        self._handled = threading.Event()
        self._stop_signal = ""  # (a signal the parent caught is not the child's)
        self._undo()  # (the forking thread is the child's main thread)

    def _release_wakeup(self) -> None:
        """Let go of ddpdoctor's wakeup fd (where it is still the one set) and close its sockets."""
        if self._wakeup is None:
            return
        reader, writer = self._wakeup
        try:
            current = signal.set_wakeup_fd(-1)
            if current not in (-1, writer.fileno()):
                signal.set_wakeup_fd(current)  # someone replaced ours since: theirs stays
        except (ValueError, OSError):
            pass
        writer.close()
        reader.close()
        self._wakeup = None

    def shutdown(self) -> None:
        """Undo what ``register`` did where it is still ours (tests, embedding applications)."""
        atexit.unregister(self._at_exit)
        self._undo()

    def _undo(self) -> None:
        """SIGTERM's handler and the wakeup fd given back where they are still ours (from the main
        thread, the only one that may set them), and every monitor forgotten."""
        if threading.current_thread() is threading.main_thread():
            if self.owns_sigterm():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._release_wakeup()
        self._handler_installed = False
        self._installed = False
        self._monitors = weakref.WeakSet()


def _say(message: str) -> None:
    try:
        warn(message, LogWriteWarning, stacklevel=2)
    except BaseException:  # noqa: BLE001 - warnings turned into errors: stderr is the last resort
        try:
            os.write(2, (message + "\n").encode())
        except OSError:
            pass
