"""Calls into user reward code: on a daemon worker thread, bounded by a timeout, interrupted by a
stop request, and whatever goes wrong said in one line.

Used by ``rl/rewards.py`` for ``module:function`` rewards: the caller (the training loop's main
thread) waits in slices of ``WAIT_SLICE`` seconds, so a SIGTERM's stop request (polled through
``should_stop``) ends the wait within a slice and ``reward_timeout`` bounds one call. Whatever the
function raises, ``SystemExit`` and ``KeyboardInterrupt`` from inside it included, becomes one
``ValueError`` naming the function and the prompt; a thread that never returns is left behind as a
daemon, which cannot keep the process alive.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

WAIT_SLICE = 0.05  # seconds between stop-flag checks while a user reward runs


class RewardsInterrupted(Exception):
    """A stop request arrived while a user reward function ran: the rollout is abandoned."""


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
        raise RewardsInterrupted(f"a stop request interrupted reward {name!r} on {where}")
    if kind == "timeout":
        raise ValueError(f"reward {name!r} took longer than reward_timeout={timeout:g}s on {where}; make it faster "
                         "or raise --reward_timeout (0 = no limit)")
    raise failure(name, where, value) from value


def failure(name: str, where: str, error: BaseException) -> ValueError:
    """A user reward's exception as one line: the function, the prompt, what it raised."""
    if isinstance(error, SystemExit):
        what = f"called sys.exit({error.code!r})"
    else:
        what = f"raised {type(error).__name__}: {error}" if str(error) else f"raised {type(error).__name__}"
    what = " ".join(what.split())  # one line, whatever the message held
    return ValueError(f"reward {name!r} {what} on {where}; a reward function must return a score (fix the "
                      "function or the prompt record it was given)")
