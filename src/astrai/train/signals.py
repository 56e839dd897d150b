"""SIGTERM / SIGINT -> a graceful stop request on the run's TrainContext.

The first thing `astrai train` does (before the model and data are built, which can take long)
is `install_signal_handlers`. A signal that arrives before a TrainContext is attached is
remembered and applied by `attach`. The training loop checks the context's stop event at every
batch boundary, publishes a checkpoint and exits 0. A second SIGINT (an impatient Ctrl-C) exits
at once with status 130 via `os._exit`, without running cleanup that could touch the last
published checkpoint (an unfinished save only ever lives in a hidden staging directory).

A rank blocked in a collective (its peer died or hung) never reaches a batch boundary, and Python
runs signal handlers only between bytecodes of the main thread, so the stop request would never
be seen. Ranks started by the local launcher (`train/launch.py` sets ``ASTRAI_STOP_TIMEOUT`` and
``ASTRAI_LAUNCHER_PID``) therefore also run a watchdog thread: it learns of SIGTERM/SIGINT through
`signal.set_wakeup_fd` (written by the C-level handler, even while the main thread is blocked) and
ends the process `stop_timeout` seconds later if it is still alive; and it treats the launcher's
death (the parent pid changes, e.g. after a SIGKILL) as a SIGTERM, in case the parent-death signal
the launcher asks for did not arrive.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Protocol

EXIT_CODE_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention


class StopTarget(Protocol):
    def request_stop(self, reason: str = ...) -> None: ...


class _State:
    ctx: StopTarget | None = None
    pending: str | None = None  # a stop reason that arrived before a context was attached
    last_signal: int | None = None
    num_signals = 0
    num_sigint = 0
    previous: dict[int, Any] = {}
    watchdog: tuple[socket.socket, socket.socket] | None = None


_state = _State()


def _handle(signum: int, frame: Any) -> None:
    _state.last_signal = signum
    _state.num_signals += 1
    if signum == signal.SIGINT:
        _state.num_sigint += 1
        if _state.num_sigint >= 2:
            # os.write, not print: only async-signal-safe calls before we leave
            os.write(2, b"second SIGINT: aborting now (exit 130); the last published checkpoint is intact\n")
            os._exit(EXIT_CODE_INTERRUPTED)
    reason = f"signal {signal.Signals(signum).name}"
    if _state.ctx is not None:
        _state.ctx.request_stop(reason)
    else:
        _state.pending = reason
    hint = " (Ctrl-C again to abort at once)" if signum == signal.SIGINT else ""
    # os.write: a print here could re-enter a stderr write the main thread was in the middle of
    os.write(2, f"{reason} received: stopping at the next batch boundary and saving a checkpoint{hint}\n".encode())


def install_signal_handlers(ctx: StopTarget | None = None) -> bool:
    """Route SIGTERM and SIGINT to a stop request; returns False off the main thread (no-op).

    Safe to call more than once; `ctx` is attached at once when given.
    """
    if threading.current_thread() is not threading.main_thread():
        return False  # Python only lets the main thread install handlers (e.g. a Trainer in a thread)
    for signum in (signal.SIGTERM, signal.SIGINT):
        current = signal.getsignal(signum)
        if current is not _handle:
            _state.previous[signum] = current
            signal.signal(signum, _handle)
    if ctx is not None:
        attach(ctx)
    if "ASTRAI_STOP_TIMEOUT" in os.environ and _state.watchdog is None:
        parent = os.environ.get("ASTRAI_LAUNCHER_PID")
        start_watchdog(float(os.environ["ASTRAI_STOP_TIMEOUT"]), int(parent) if parent else None)
    return True


WATCHDOG_POLL_S = 0.2


def start_watchdog(stop_timeout: float, parent_pid: int | None = None) -> None:
    """From the main thread: a daemon thread that ends this process (exit 128 + the signal)
    `stop_timeout` seconds after the first SIGTERM/SIGINT, however blocked the main thread is, and
    that sends this process SIGTERM when `parent_pid` is no longer its parent (the launcher died)."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    _state.watchdog = (reader, writer)  # kept open for the process's life

    def watch() -> None:
        deadline, signum, parent = None, signal.SIGTERM, parent_pid
        while True:
            ready, _, _ = select.select([reader], [], [], WATCHDOG_POLL_S)
            if ready:
                got = [n for n in reader.recv(64) if n in (signal.SIGTERM, signal.SIGINT)]
                if got and deadline is None:
                    deadline, signum = time.monotonic() + stop_timeout, got[0]
            if parent is not None and os.getppid() != parent:
                parent = None
                os.write(2, b"the launcher is gone: stopping this rank\n")
                os.kill(os.getpid(), signal.SIGTERM)  # the handler asks for a stop; the wakeup fd starts the clock
            if deadline is not None and time.monotonic() > deadline:
                os.write(2, f"still running {stop_timeout:g}s after {signal.Signals(signum).name} (blocked, e.g. in a "
                            "collective whose peer is gone): exiting now\n".encode())
                os._exit(128 + signum)

    threading.Thread(target=watch, name="astrai-stop-watchdog", daemon=True).start()


def attach(ctx: StopTarget) -> None:
    """Make `ctx` the target of stop requests; a signal received earlier stops it now."""
    _state.ctx = ctx
    if _state.pending is not None:
        ctx.request_stop(_state.pending)
        _state.pending = None


def last_signal() -> int | None:
    """The last signal handled (the launcher forwards it to ranks it starts afterwards)."""
    return _state.last_signal


def uninstall_signal_handlers() -> None:
    """Restore the handlers found at install time and forget the context (tests, embedding)."""
    if threading.current_thread() is threading.main_thread():
        for signum, handler in _state.previous.items():
            signal.signal(signum, handler)
    _state.previous = {}
    _state.ctx = None
    _state.pending = None
    _state.last_signal = None
    _state.num_sigint = 0


def pause_point(event: str) -> None:
    """Test hook: lets a test kill or stop a run at an exact moment instead of racing the clock.

    With ``ASTRAI_PAUSE_AT`` equal to `event` (e.g. ``step:3``, ``publish-sealed:4``), the process
    creates the file ``$ASTRAI_PAUSE_FILE.<pid>`` and then waits until a SIGTERM/SIGINT arrives
    (the run then stops gracefully) or it is killed. A no-op otherwise (one dict lookup).
    """
    if os.environ.get("ASTRAI_PAUSE_AT") != event:
        return
    seen = _state.num_signals  # before the file: a test's signal sent once it sees the file must count
    Path(f"{os.environ['ASTRAI_PAUSE_FILE']}.{os.getpid()}").write_text(event)
    while _state.num_signals == seen:
        time.sleep(0.01)
