"""Tools for multi-turn rollouts: Python functions -> JSON-schema tools the model can call.

``rl.tools: [module:function, ...]`` names plain Python functions (sync or ``async def``); as in
TRL, each one's type hints and docstring become its schema (``function_schema``, in the data
layer beside the parser: the first docstring paragraph is the description, a Google-style
``Args:`` section describes the parameters, parameters without a default are required). The
schemas go to the chat template's ``tools`` variable; the model's ``<tool_call>`` blocks are read by the server's parser
(``astrai.data.tool_calls``) and ``ToolBox.call`` runs them: the result (a string, or anything
JSON can write) becomes a ``tool`` message; a tool that raises (``SystemExit`` and
``KeyboardInterrupt`` included), runs past ``tool_timeout``, returns what JSON cannot write, or a
call whose arguments do not fit, gives the model an ``error: ...`` message instead (counted), never
a crash. Calls run through ``rl/guard.py``'s ``UserHooks``: a sync tool on a worker thread, so a
slow one does not hold up the other episodes. Used by ``rl/episode.py``; an environment may offer
tools of its own (its ``tools`` attribute).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from astrai.data.tool_calls import ToolCall, function_schema, parse_tool_calls
from astrai.train.rl.guard import UserHooks, raised


def tool_schema(fn: Callable[..., Any], where: str) -> dict[str, Any]:
    """`fn`'s JSON schema; what keeps it from having one (a parameter without a type hint, a type
    JSON cannot carry) is one line naming `where` the tool came from."""
    try:
        return function_schema(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"tool {where!r}: {e}") from None


class ToolBox:
    """The tools of one episode: their schemas (for the chat template) and a runner of calls."""

    def __init__(self, functions: list[Callable[..., Any]]):
        self.functions: dict[str, Callable[..., Any]] = {}
        for fn in functions:
            name = tool_schema(fn, getattr(fn, "__qualname__", repr(fn)))["function"]["name"]
            if name in self.functions:
                raise ValueError(f"two tools are named {name!r}; tool names must be unique (rename one)")
            self.functions[name] = fn
        self.schemas = [function_schema(fn) for fn in self.functions.values()]

    def __bool__(self) -> bool:
        return bool(self.functions)

    def parse(self, text: str) -> list[ToolCall]:
        """The calls of known tools in an assistant's text (the server's parser)."""
        return parse_tool_calls(text, set(self.functions))[1] if self.functions else []

    async def call(self, call: ToolCall, hooks: UserHooks, timeout: float = 0.0) -> tuple[str, str]:
        """(the tool message's content, the outcome: "" for a result, else "error" or "timeout"),
        the tool run by `hooks` within `timeout` seconds (0 = no limit); an async tool awaited."""
        try:
            args = json.loads(call.arguments)
            if not isinstance(args, dict):
                return f"error: the arguments of {call.name} must be a JSON object, got {call.arguments}", "error"
            inspect.signature(self.functions[call.name]).bind(**args)
        except (ValueError, TypeError) as e:
            return f"error: bad arguments for {call.name}: {e}", "error"
        fn = self.functions[call.name]
        kind, value = await hooks.call(lambda: fn(**args), timeout, f"tool {call.name}")
        if kind == "timeout":
            return (f"error: {call.name} took longer than tool_timeout={timeout:g}s and was abandoned (its result, if "
                    "any, is dropped)"), "timeout"
        if kind == "error":  # the model sees what went wrong; the run goes on
            return f"error: {call.name} {raised(value)}", "error"
        return tool_text(call.name, value)


def tool_text(name: str, result: Any) -> tuple[str, str]:
    """A tool's result as the tool message's text: a str as it is, anything else as JSON; what JSON
    cannot write (tuple keys, a circular list, a ``__str__`` that raises) is an error message."""
    if isinstance(result, str):
        return result, ""
    try:
        return json.dumps(result, ensure_ascii=False, default=str), ""
    except Exception as e:  # whatever the value's own methods raise, too
        return (f"error: {name} returned a {type(result).__name__} that cannot be written as JSON "
                f"({raised(e).removeprefix('raised ')}); return a str or JSON data"), "error"
