"""Environments for multi-turn online RL: the user's hooks and the built-in calculator example.

``rl.environment: module:Class`` (resolved like user rewards, from the working directory,
``rl/user_code.py``) is constructed with no arguments once per sample: every episode has its own
instance, so state kept on ``self`` belongs to one conversation. ``reset(record) -> list[message]``
opens the episode (no ``reset``: the record's messages); ``step(messages) -> EnvStep`` is called
after each assistant turn that calls no tool, with the whole conversation; its messages are
appended, its reward added to the episode's, and ``done`` ends it. Either method may be
``async def``: the episodes of a rollout are awaited together; a sync one runs on a worker
thread (``rl/guard.py``), concurrently with the other episodes'. Every call is bounded by
``env_timeout`` and interrupted by a stop request. ``rl.tools`` (and an environment's
``tools`` attribute) are offered through the chat template (``rl/tools.py``). The episode runner
(``rl/runner.py``) owns the turn loop and calls these hooks through ``rl/episode.py``; nothing here
calls back into it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from astrai.data.tasks import multiply
from astrai.train.rl.guard import UserHooks, raised
from astrai.train.rl.rewards import F32_MAX, finite_number
from astrai.train.rl.tools import tool_schema
from astrai.train.rl.user_code import import_user_object

Message = dict[str, Any]


@dataclass
class EnvStep:
    """An environment's answer to an assistant turn."""

    messages: list[Message] | None = None  # appended to the conversation (e.g. a user follow-up)
    reward: float | None = None  # added to the episode's reward
    done: bool = False


class CalculatorEnv:
    """The built-in example (``rl.environment: astrai.train.rl.environments:CalculatorEnv``):
    arithmetic prompts with a ``multiply`` tool (``astrai.data.tasks``); the episode ends at the
    first turn that calls no tool, its answer scored by the configured rewards (``exact_match``).
    ``tool_trace_record`` writes SFT traces of the same conversations."""

    tools = [multiply]

    def step(self, messages: list[Message]) -> EnvStep:
        return EnvStep(done=True)


def environment_class(spec: str) -> type:
    cls = import_user_object(spec, "environment", "a class with reset(record) and step(messages)")
    if not callable(getattr(cls, "step", None)):
        raise ValueError(f"environment {spec!r} ({getattr(cls, '__name__', cls)!r}) has no step(messages) method; "
                         "define step(self, messages) -> EnvStep on it")
    return cls


def tool_functions(specs: list[str]) -> list[Callable[..., Any]]:
    """The functions ``rl.tools`` names, each checked: a function (not a class), with a schema."""
    functions = []
    for spec in specs:
        fn = import_user_object(spec, "tool", "a function with type hints and a docstring")
        if inspect.isclass(fn) or not callable(fn):
            found = f"the class {fn.__name__}" if inspect.isclass(fn) else f"a {type(fn).__name__}"
            raise ValueError(f"tool {spec!r} is {found}, not a function; name a function (a tool is called with the "
                             "model's arguments; to offer a class's methods, list them as an environment's tools)")
        tool_schema(fn, spec)
        functions.append(fn)
    return functions


def check_hooks(environment: str | None, tools: list[str]) -> None:
    """Import and check the environment and tools a config names (a mistyped name is the first error
    a run reports, before the model is built)."""
    if environment:
        environment_class(environment)
    tool_functions(tools)


async def env_call(hooks: UserHooks, env: Any, method: str, args: tuple, where: str, timeout: float) -> Any:
    """An environment method (`env` is the class for ``__init__``) run by `hooks` within `timeout`
    seconds (0 = no limit); whatever it raises, or running past the timeout, is one line naming the
    environment, the method and `where` (the episode): the run stops, an environment bug is not a score."""
    cls = env if method == "__init__" else type(env)
    name = f"environment {getattr(cls, '__name__', cls)}.{method}"
    fn = env if method == "__init__" else getattr(env, method)
    kind, value = await hooks.call(lambda: fn(*args), timeout, f"{name} ({where})")
    if kind == "timeout":
        raise ValueError(f"{name} took longer than env_timeout={timeout:g}s ({where}); make it faster or raise "
                         "--env_timeout (0 = no limit)")
    if kind == "error":
        raise ValueError(f"{name} {raised(value)} ({where}); fix the environment (a tool's errors go to the model, "
                         "an environment's stop the run)") from value
    return value


def checked_messages(messages: Any, name: str, where: str, empty_ok: bool = True) -> list[Message]:
    """An environment's messages (`name`: "environment X.reset"), copied: a list of dicts, each with
    a str ``role`` and a str ``content``; anything else is one line naming the environment, the
    episode (`where`) and what was found. `empty_ok`: False for ``reset``, which opens the episode."""
    if not isinstance(messages, list):
        raise ValueError(f"{name} returned {type(messages).__name__} {_short(messages)} ({where}), not a list of "
                         "messages; return [{'role': 'user', 'content': '...'}, ...]")
    if not messages and not empty_ok:
        raise ValueError(f"{name} returned no messages ({where}); return the opening conversation, at least "
                         "[{'role': 'user', 'content': '...'}]")
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{name} returned {type(m).__name__} {_short(m)} as message {k} ({where}); a message is "
                             "a dict with a str 'role' and a str 'content'")
    return [dict(m) for m in messages]


def checked_step(result: Any, name: str, where: str) -> tuple[list[Message], float]:
    """An environment's ``step`` answer as (its messages, its reward): an ``EnvStep`` whose reward is
    None or a number finite in float32; anything else is one line naming the environment."""
    if not isinstance(result, EnvStep):
        raise ValueError(f"{name} returned {type(result).__name__} {_short(result)} ({where}), not an EnvStep; "
                         "return EnvStep(messages=..., reward=..., done=...)")
    reward = 0.0 if result.reward is None else finite_number(result.reward)
    if reward is None:
        raise ValueError(f"{name} returned reward={_short(result.reward)} ({where}); a reward is None or a number "
                         f"finite in float32 (|r| <= {F32_MAX:.3g})")
    messages = [] if result.messages is None else checked_messages(result.messages, name, where)
    return messages, reward


def _short(value: Any) -> str:
    """A value for an error line: its repr, one line, at most 80 characters."""
    try:
        text = " ".join(repr(value).split())
    except Exception:  # a user object whose __repr__ raises
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."
