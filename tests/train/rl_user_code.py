"""User code that test runs name by import path (`rl.tools`, `rl.environment`, `rl.rewards` as
`module:name`): tools, environments and rewards that runs of several test modules load, kept here
so that no run imports a test module."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading

from astrai.train.rl.environments import EnvStep

USER_CODE = "tests.train.rl_user_code"  # the module path runs name these by


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b (int): the second factor
    """
    return a * b


def broken(x: str) -> str:
    """Always fails."""
    raise RuntimeError(f"cannot handle {x}")


class ScriptedEnv:
    """Three assistant turns: two user follow-ups, then done with reward 1 (0.5 per follow-up)."""

    def reset(self, record):
        self.turn = 0
        return [{"role": "system", "content": "be brief"}, *record["messages"]]

    def step(self, messages):
        assert messages[-1]["role"] == "assistant"
        self.turn += 1
        if self.turn < 3:
            return EnvStep(messages=[{"role": "user", "content": f"again {self.turn}"}], reward=0.5)
        return EnvStep(reward=1.0, done=True)


class StoppingEnv(ScriptedEnv):
    """ScriptedEnv that, with ASTRAI_TEST_SIGTERM_AT_CALL=N, sends its own process a SIGTERM at
    the N-th step call: a stop request that lands while a rollout's episodes are in flight."""

    num_calls = 0

    def step(self, messages):
        StoppingEnv.num_calls += 1
        if StoppingEnv.num_calls == int(os.environ.get("ASTRAI_TEST_SIGTERM_AT_CALL", "0")):
            os.kill(os.getpid(), signal.SIGTERM)
        return super().step(messages)


class EndlessEnv:
    """Never done: every episode runs into max_turns."""

    def step(self, messages):
        return EnvStep(messages=[{"role": "user", "content": "more"}])


class FailingEnv:
    def step(self, messages):
        raise KeyError("score")


class BarrierEnv:
    """Async: each step waits until every episode of the rollout has entered one, which only
    happens when the steps are awaited together (one at a time, the first would wait forever)."""

    expected = 0
    arrived: list[int] = []
    event: asyncio.Event | None = None

    async def step(self, messages):
        cls = type(self)
        if cls.event is None or not cls.arrived:
            cls.event = asyncio.Event()
        cls.arrived.append(1)
        if len(cls.arrived) == cls.expected:
            cls.event.set()
        await asyncio.wait_for(cls.event.wait(), timeout=60)
        return EnvStep(reward=float(len(cls.arrived)), done=True)



class SlowEnv(BarrierEnv):
    """Async: each step waits for every episode, as BarrierEnv, then `seconds` more: the episodes'
    steps overlap by construction, each one's own span at least `seconds` long."""

    seconds = 0.05

    async def step(self, messages):
        result = await super().step(messages)
        await asyncio.sleep(type(self).seconds)
        return result

def varied_reward(prompt, completion, record):
    """Rewards that differ within a group, so the first step moves the adapters."""
    return float(len(completion) % 3)


def exits_zero(prompt, completion, record):
    sys.exit(0)


RELEASE = threading.Event()  # set by a test's teardown: lets the hooks that hang here return
HANGING = threading.Event()  # set when a hook starts hanging (in-process runs)


def hang_marker() -> None:
    """Say that a hook now hangs: the in-process event, and, with ASTRAI_TEST_HANG_FILE, a file
    (a test that drives a subprocess waits for it before it sends SIGTERM)."""
    HANGING.set()
    if os.environ.get("ASTRAI_TEST_HANG_FILE"):
        open(os.environ["ASTRAI_TEST_HANG_FILE"], "w").close()


class HangingEnv(ScriptedEnv):
    """ScriptedEnv whose step hangs (until RELEASE) from its N-th call on, N being
    ASTRAI_TEST_HANG_AT_CALL (default 1): an environment that never answers."""

    num_calls = 0

    def step(self, messages):
        HangingEnv.num_calls += 1
        if HangingEnv.num_calls >= int(os.environ.get("ASTRAI_TEST_HANG_AT_CALL", "1")):
            hang_marker()
            RELEASE.wait()
        return super().step(messages)


def hanging_tool(x: int) -> int:
    """A tool that hangs until the test releases it."""
    hang_marker()
    RELEASE.wait()
    return x
