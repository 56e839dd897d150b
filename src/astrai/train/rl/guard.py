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


def call_in_worker(call: Callable[[], Any], timeout: float, should_stop: Callable[[], bool] | None) -> tuple[str, Any]:
    """`call()` on a daemon worker thread, waited for in slices of WAIT_SLICE seconds with the
    stop flag and the timeout checked between them: (kind, value), kind one of value, error,
    timeout, stop."""
    box: list[tuple[str, Any]] = []
    done = threading.Event()

    def work() -> None:
        try:
            box.append(("value", call()))
        except BaseException as e:  # SystemExit / KeyboardInterrupt too: an error of this reward
            box.append(("error", e))
        finally:
            done.set()

    threading.Thread(target=work, name="astrai-reward", daemon=True).start()
    deadline = time.monotonic() + timeout if timeout > 0 else None
    while not done.wait(WAIT_SLICE if deadline is None else max(0.0, min(WAIT_SLICE, deadline - time.monotonic()))):
        # the main thread waits here: a signal handler (the stop request) runs between slices
        if should_stop is not None and should_stop():
            return "stop", None
        if deadline is not None and time.monotonic() >= deadline:
            return "timeout", None
    return box[0]


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
