"""Tools for multi-turn rollouts: Python functions -> JSON-schema tools the model can call.

``rl.tools: [module:function, ...]`` names plain Python functions (sync or ``async def``); as in
TRL, each one's type hints and docstring become its schema (``function_schema``, in the data
layer beside the parser: the first docstring paragraph is the description, a Google-style
``Args:`` section describes the parameters, parameters without a default are required). The
schemas go to the chat template's ``tools`` variable; the model's ``<tool_call>`` blocks are read by the server's parser
(``astrai.data.tool_calls``) and ``ToolBox.call`` runs them: the result (a string, or anything
JSON can write) becomes a ``tool`` message; a tool that raises, or a call whose arguments do not
fit, gives the model an ``error: ...`` message instead (counted), never a crash. Used by
``rl/environments.py``; an environment may offer tools of its own (its ``tools`` attribute).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from astrai.data.tool_calls import ToolCall, function_schema, parse_tool_calls


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

    async def call(self, call: ToolCall) -> tuple[str, bool]:
        """(the tool message's content, whether it is an error). Awaits an async tool."""
        try:
            args = json.loads(call.arguments)
            if not isinstance(args, dict):
                return f"error: the arguments of {call.name} must be a JSON object, got {call.arguments}", True
            inspect.signature(self.functions[call.name]).bind(**args)
        except (ValueError, TypeError) as e:
            return f"error: bad arguments for {call.name}: {e}", True
        try:
            result = self.functions[call.name](**args)
            if inspect.isawaitable(result):
                result = await result
        except Exception as e:  # the model sees what went wrong; the run goes on
            return f"error: {call.name} raised {type(e).__name__}: {e}", True
        return (result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)), False
