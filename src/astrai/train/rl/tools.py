"""Tools for multi-turn rollouts: Python functions -> JSON-schema tools the model can call.

``rl.tools: [module:function, ...]`` names plain Python functions (sync or ``async def``); as in
TRL, each one's type hints and docstring become its schema (``function_schema``): the first
docstring paragraph is the description, a Google-style ``Args:`` section describes the
parameters, parameters without a default are required. The schemas go to the chat template's
``tools`` variable; the model's ``<tool_call>`` blocks are read by the server's parser
(``astrai.data.tool_calls``) and ``ToolBox.call`` runs them: the result (a string, or anything
JSON can write) becomes a ``tool`` message; a tool that raises, or a call whose arguments do not
fit, gives the model an ``error: ...`` message instead (counted), never a crash. Used by
``rl/environments.py``; an environment may offer tools of its own (its ``tools`` attribute).
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from astrai.data.tool_calls import ToolCall, parse_tool_calls

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object", list: "array",
               type(None): "null"}


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one type hint (int, float, str, bool, list[X], dict, X | None, Literal)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is typing.Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        kinds = [_json_type(a, where) for a in args if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else {"anyOf": kinds}
    if origin in (list, tuple, set):
        return {"type": "array", **({"items": _json_type(args[0], where)} if args and args[0] is not ... else {})}
    if origin is dict:
        return {"type": "object"}
    raise TypeError(f"{where} has the type hint {hint!r}, which has no JSON schema here; use int, float, str, "
                    "bool, list[...], dict, a Literal or X | None")


def _arg_docs(doc: str) -> dict[str, str]:
    """Parameter descriptions from a Google-style ``Args:`` section (``name (type): text``)."""
    match = re.search(r"^\s*(?:Args|Arguments|Parameters):\s*\n(.*?)(?:\n\s*\n|\n\s*\w+:\s*\n|\Z)", doc, re.S | re.M)
    if not match:
        return {}
    out: dict[str, str] = {}
    name = None
    for line in match.group(1).splitlines():
        item = re.match(r"\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
        if item:
            name, out[item.group(1)] = item.group(1), item.group(2).strip()
        elif name and line.strip():
            out[name] += " " + line.strip()
    return out


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI-style tool of a Python function: ``{"type": "function", "function": {name,
    description, parameters}}``. Every parameter needs a type hint (the model must know what to send)."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    doc = inspect.getdoc(fn) or ""
    hints = typing.get_type_hints(fn)
    described = _arg_docs(doc)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name not in hints:
            raise TypeError(f"tool {name!r}: parameter {param.name!r} has no type hint; annotate it (e.g. "
                            f"{param.name}: int) so the tool's JSON schema can say what to send")
        properties[param.name] = _json_type(hints[param.name], f"tool {name!r} parameter {param.name!r}")
        if param.name in described:
            properties[param.name]["description"] = described[param.name]
        if param.default is param.empty:
            required.append(param.name)
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


class ToolBox:
    """The tools of one episode: their schemas (for the chat template) and a runner of calls."""

    def __init__(self, functions: list[Callable[..., Any]]):
        self.functions: dict[str, Callable[..., Any]] = {}
        for fn in functions:
            name = function_schema(fn)["function"]["name"]
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
