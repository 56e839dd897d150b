"""Calls into user code during a rollout (rewards, tools, environments): on daemon worker
threads, bounded by a timeout, interrupted by a stop request, and whatever goes wrong said in one line.

The caller (the training loop's main thread) waits in slices of ``WAIT_SLICE`` seconds
(``call_in_worker``), so a SIGTERM's stop request (polled through ``should_stop``) ends the wait
within a slice. ``rl/rewards.py`` runs ``module:function`` rewards this way, one call at a time,
each bounded by ``reward_timeout``: whatever one raises, ``SystemExit`` and ``KeyboardInterrupt``
from inside it included, becomes one ``ValueError`` naming the function and the prompt.
``UserHooks`` runs a rollout turn's tool and environment calls (``rl/episode.py``) the same way:
the turn's event loop on a worker thread, each sync call on a daemon thread of its own (at most
``MAX_HOOK_THREADS`` at a time, so a slow tool no longer holds up the other episodes), each call
bounded by its timeout (``tool_timeout``, ``env_timeout``) and reported as an outcome, never
raised. A thread that never returns is left behind as a daemon, which cannot keep the process alive.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

WAIT_SLICE = 0.05  # seconds between stop-flag checks while user code runs
MAX_HOOK_THREADS = 32  # sync tool / environment calls running at once (their daemon threads)
T = TypeVar("T")


class UserCodeInterrupted(Exception):
    """A stop request arrived while user code (a reward, a tool, an environment) ran: the rollout is abandoned."""


def call_in_worker(calls: list[Callable[[], Any]], timeout: float,
                   should_stop: Callable[[], bool] | None) -> tuple[str, Any, int]:
    """Each of `calls` in turn on one daemon worker thread, waited for in slices of WAIT_SLICE
    seconds with the stop flag and the running call's time checked between them: (kind, value,
    index). kind "value": value is the list of results; else ("error", the exception), "timeout"
    or "stop", for the call at `index`. One thread for all the calls: a thread per call would
    cost more than a quick reward itself."""
    results: list[Any] = []
    running = [(0, time.monotonic())]  # (index, start) of the call in progress: one tuple, swapped whole
    failed: list[BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            for i, call in enumerate(calls):
                running[0] = (i, time.monotonic())
                results.append(call())
        except BaseException as e:  # SystemExit / KeyboardInterrupt too: an error of this reward
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=work, name="astrai-reward", daemon=True).start()
    while True:
        index, start = running[0]
        left = start + timeout - time.monotonic() if timeout > 0 else WAIT_SLICE
        # the main thread waits here: a signal handler (the stop request) runs between slices
        if done.wait(max(0.0, min(WAIT_SLICE, left))):
            break
        if should_stop is not None and should_stop():
            return "stop", None, running[0][0]
        if timeout > 0 and running[0] == (index, start) and time.monotonic() - start >= timeout:
            return "timeout", None, index
    if failed:
        return "error", failed[0], len(results)
    return "value", results, len(results)


def outcome(name: str, where: str, kind: str, value: Any, timeout: float) -> Any:
    """A user reward call's value, or its failure raised as one line naming it and the prompt."""
    if kind == "value":
        return value
    if kind == "stop":
        raise UserCodeInterrupted(f"a stop request interrupted reward {name!r} on {where}")
    if kind == "timeout":
        raise ValueError(f"reward {name!r} took longer than reward_timeout={timeout:g}s on {where}; make it faster "
                         "or raise --reward_timeout (0 = no limit)")
    raise failure(name, where, value) from value


def failure(name: str, where: str, error: BaseException) -> ValueError:
    """A user reward's exception as one line: the function, the prompt, what it raised."""
    return ValueError(f"reward {name!r} {raised(error)} on {where}; a reward function must return a score (fix the "
                      "function or the prompt record it was given)")


def raised(error: BaseException) -> str:
    """What user code raised, as one line: ``called sys.exit(3)``, ``raised KeyError: 'x'``; an
    exception whose ``__str__`` itself fails is named by its type."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r})"
    try:
        text = str(error)
    except Exception:  # a user exception whose message cannot be made
        text = ""
    what = f"raised {type(error).__name__}: {text}" if text else f"raised {type(error).__name__}"
    return " ".join(what.split())  # one line, whatever the message held


class UserHooks:
    """A run's tool and environment calls (module docstring): ``run`` is one rollout turn (or the
    episodes' opening) on an event loop in a worker thread, waited for in slices and abandoned on a
    stop request (``UserCodeInterrupted``, naming a call in progress); ``call`` is one user call
    inside it."""

    def __init__(self, should_stop: Callable[[], bool] | None = None):
        self.should_stop = should_stop
        self.running: dict[int, str] = {}  # calls in progress: id -> what (the stop note names one)
        self.slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None  # of the current loop

    def run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """The coroutine `make()` gives, run to its end on a fresh event loop in a worker thread;
        its exception is raised here."""
        started: list[tuple[asyncio.AbstractEventLoop, asyncio.Task]] = []

        async def main() -> T:
            started.append((asyncio.get_running_loop(), asyncio.current_task()))
            return await make()

        kind, value, _ = call_in_worker([lambda: asyncio.run(main())], 0.0, self.should_stop)
        if kind == "stop":
            what = (list(self.running.values()) or ["a tool or environment call"])[0]
            if started:  # the rest of the turn is dropped: no more calls start
                loop, task = started[0]
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:  # the loop has already closed
                    pass
            raise UserCodeInterrupted(f"a stop request interrupted {what}")
        if kind == "error":
            raise value
        return value[0]

    async def call(self, fn: Callable[[], Any], timeout: float, what: str) -> tuple[str, Any]:
        """`fn()` from the turn's event loop: ("value", its result), ("error", what it raised,
        ``SystemExit`` and ``KeyboardInterrupt`` included) or ("timeout", None) once it ran past
        `timeout` seconds (0 = no limit). It runs on a daemon thread, so the loop and the other
        episodes' calls go on; an awaitable it returns (an ``async def``) is awaited on the loop
        within the same timeout. `what` names the call for a stop note."""
        key = id(fn)
        self.running[key] = what
        start = time.monotonic()
        try:
            async with self._slots():
                kind, value = await _bounded(_in_thread(fn), timeout)
            if kind == "value" and inspect.isawaitable(value):
                left = max(timeout - (time.monotonic() - start), 1e-3) if timeout > 0 else 0.0
                kind, value = await _bounded(_settled(value), left)
            return kind, value
        finally:
            self.running.pop(key, None)

    def _slots(self) -> asyncio.Semaphore:
        """The cap on sync calls at once, one semaphore per event loop (each turn has its own)."""
        loop = asyncio.get_running_loop()
        if self.slots is None or self.slots[0] is not loop:
            self.slots = (loop, asyncio.Semaphore(MAX_HOOK_THREADS))
        return self.slots[1]


async def _bounded(outcome: Awaitable[tuple[str, Any]], timeout: float) -> tuple[str, Any]:
    try:
        return await (asyncio.wait_for(outcome, timeout) if timeout > 0 else outcome)
    except TimeoutError:
        return "timeout", None


def _in_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """A future of fn()'s outcome, computed on a new daemon thread (never awaited after a timeout:
    the thread is left to finish or hang on its own)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: tuple[str, Any]) -> None:
        if not future.done():  # not after a timeout or a cancelled turn
            future.set_result(outcome)

    def work() -> None:
        try:
            outcome: tuple[str, Any] = ("value", fn())
        except BaseException as e:  # SystemExit / KeyboardInterrupt too: an outcome of this call
            outcome = ("error", e)
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the turn's loop has closed (it gave up on this call)
            pass

    threading.Thread(target=work, name="astrai-hook", daemon=True).start()
    return future


async def _settled(awaitable: Awaitable[Any]) -> tuple[str, Any]:
    """An async user call's outcome; what it raises, ``SystemExit`` included, is its "error"."""
    try:
        return "value", await awaitable
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # the turn is being cancelled, not the call failing
            raise
        return "error", asyncio.CancelledError("the call cancelled itself")
    except BaseException as e:
        return "error", e
