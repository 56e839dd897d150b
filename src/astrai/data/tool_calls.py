"""Tool-call parsing: a model's `<tool_call>{json}</tool_call>` text -> `ToolCall`s.

The chat template shows the model its tools (the `tools` variable) and how to call one: the
ChatML/Qwen/Hermes convention `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. After
generation `parse_tool_calls` splits a text into content and calls; while streaming,
`ToolCallStream` holds back text that may be the start of a call and releases each call whole
once its closing tag arrived; `function_schema` turns a typed, documented Python function into
the tool the template shows. A block whose JSON does not parse, or that names a function that
was not offered, or whose JSON nests objects and arrays deeper than `MAX_JSON_DEPTH`, stays in
the content verbatim: a call is never invented. Pure text handling in
the data layer, so the server (`serve/render.py`'s OpenAI `tool_calls`, `serve/anthropic.py`'s
`tool_use` blocks) and online RL's multi-turn rollouts (`train/rl/tools.py`) read the model's
calls with one parser. The JSON inside a block is read with the standard library's `json`;
constrained decoding (`infer/guided.py`) is what makes required and named calls parse in the
first place.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
MAX_JSON_DEPTH = 64  # objects and arrays nested deeper in a block: not a call (json would recurse that deep)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def read_call(block: str, known_names: set[str]) -> ToolCall | None:
    """The call in the text between the tags, or None when it is not a valid call of a known tool
    (its JSON nested deeper than MAX_JSON_DEPTH included: a parse error, never a RecursionError)."""
    if too_deep(block):
        return None
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in known_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models send arguments already as JSON text
        if too_deep(args):
            return None
        try:
            json.loads(args)
        except ValueError:
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON `text` nests objects and arrays deeper than `limit` (brackets inside strings
    do not count); one pass, no recursion."""
    depth = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > limit:
            return True
    return False


def parse_tool_calls(text: str, known_names: set[str], parallel: bool = True) -> tuple[str, list[ToolCall]]:
    """Split generated text into (content, calls). Invalid blocks, and blocks beyond the first
    when parallel calls are off, stay in the content as they were written."""
    stream = ToolCallStream(known_names, parallel)
    pieces = stream.feed(text) + stream.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    return (content.strip() if calls else content), calls


class ToolCallStream:
    """Incremental split of text deltas into content strings and whole `ToolCall`s."""

    def __init__(self, known_names: set[str], parallel: bool = True):
        self.known_names, self.parallel = known_names, parallel
        self.pending = ""  # text held back: an open block, or what may be the start of one
        self.num_calls = 0

    def feed(self, delta: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        text = self.pending + delta
        while text:
            start = text.find(TOOL_CALL_OPEN)
            if start < 0 or not self._may_call():
                keep = 0 if not self._may_call() else _partial_suffix(text, TOOL_CALL_OPEN)
                out.append(text[: len(text) - keep])
                text = text[len(text) - keep:]
                break
            if start:
                out.append(text[:start])
                text = text[start:]
            end = text.find(TOOL_CALL_CLOSE)
            if end < 0:
                break  # the block is still open: wait for more
            block_end = end + len(TOOL_CALL_CLOSE)
            call = read_call(text[len(TOOL_CALL_OPEN):end], self.known_names)
            if call is None:
                out.append(text[:block_end])
            else:
                self.num_calls += 1
                out.append(call)
            text = text[block_end:]
        self.pending = text
        return [p for p in out if not isinstance(p, str) or p]

    def finish(self) -> list[str | ToolCall]:
        """Whatever is still held back (an unterminated block) is content."""
        rest, self.pending = self.pending, ""
        return [rest] if rest else []

    def _may_call(self) -> bool:
        return self.parallel or self.num_calls == 0


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- schemas: Python functions -> JSON-schema tools (TRL's convention) -----------------------

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
