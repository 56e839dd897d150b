"""Anthropic Messages API (`POST /v1/messages`): request schema, error body and renderer.

The route in `app.py` validates the body against `MessagesRequest`, renders the conversation
through the same chat template as `/v1/chat/completions` (the `system` field becomes a leading
system message) and submits it to the same engine. Tools take the OpenAI route's path: their
definitions (`name`, `description`, `input_schema`) reach the template as OpenAI `tools`, an
assistant's `tool_use` blocks become its `tool_calls` and a user's `tool_result` blocks become
`tool` messages, and `tool_choice` `any` / `tool` is the grammar of `required` / a named
function (`requests.grammar_guide`). `MessagesRenderer` reuses the choice accumulator of
`render.py` and the tool-call parser of `tools.py`, and writes Anthropic's shapes: a `message`
with `text` and `tool_use` content blocks and `stop_reason`, or the SSE sequence
`message_start`, per block `content_block_start`, `content_block_delta`* (`text_delta` or
`input_json_delta`), `content_block_stop`, then `message_delta` (stop reason, output usage),
`message_stop`. Errors use Anthropic's body `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from astrai.data.tool_calls import ToolCall, ToolCallStream, parse_tool_calls
from astrai.serve.async_engine import OutputStream
from astrai.serve.protocol import StrictModel, check_stops, sampling_field
from astrai.serve.render import Choice, Renderer

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
               422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False  # accepted; the template sees the result's text either way

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> AnthropicMessage:
        wrong = {"user": "tool_use", "assistant": "tool_result"}[self.role]
        if isinstance(self.content, list) and any(b.type == wrong for b in self.content):
            raise ValueError(f"a {self.role} message cannot hold a {wrong} block; tool_use blocks belong to "
                             "assistant messages, tool_result blocks to user messages")
        return self

    def to_template(self) -> list[dict[str, Any]]:
        """As chat-template messages, the way the OpenAI route sees them: an assistant turn with its
        `tool_calls`; each tool_result a `tool` message, text around them a user message."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "assistant":
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in self.content if isinstance(b, ToolUseBlock)]
            text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
            return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
        out: list[dict[str, Any]] = []
        for block in self.content:
            if isinstance(block, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            elif out and out[-1]["role"] == "user":
                out[-1]["content"] += block.text
            else:
                out.append({"role": "user", "content": block.text})
        return out or [{"role": "user", "content": ""}]


class AnthropicTool(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    def to_openai(self) -> dict[str, Any]:
        """The definition as the OpenAI route hands it to the chat template."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": {**function, "parameters": self.input_schema}}


class AnthropicToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_with_tool(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("type 'tool' needs the tool's name, and only type 'tool' takes a name")
        return self


class MessagesRequest(StrictModel):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = sampling_field("temperature", le=1.0)  # Anthropic's range is [0, 1]
    top_p: float | None = sampling_field("top_p")
    top_k: int | None = sampling_field("top_k", ge=0)  # Anthropic has no -1 for "off"
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None

    # what the shared renderer skeleton and grammar_guide read (never taken from a request body)
    n: ClassVar[int] = 1
    stream_options: ClassVar[None] = None
    response_format: ClassVar[None] = None

    def stop_list(self) -> list[str]:
        return list(self.stop_sequences or [])

    @field_validator("stop_sequences")
    @classmethod
    def _bounded_stops(cls, value: list[str] | None) -> list[str] | None:
        if value and not all(value):
            raise ValueError("stop sequences must be non-empty strings")
        check_stops(value or [])
        return value

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, value: list[AnthropicTool] | None) -> list[AnthropicTool] | None:
        names = [t.name for t in value or []]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # a call names its tool: two of one name would make the call ambiguous (Anthropic refuses too)
            raise ValueError(f"tool names must be unique, but {', '.join(repr(n) for n in twice)} is given more than "
                             "once; rename or drop the duplicates")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, value: AnthropicToolChoice | None, info: ValidationInfo) -> Any:
        names = [t.name for t in info.data.get("tools") or []]
        if value is not None and value.type == "tool" and value.name not in names:
            raise ValueError(f"names the tool '{value.name}' but the tools offered are {names or 'none'}; "
                             "add it to tools or name one of them")
        if value is not None and value.type == "any" and not names:
            raise ValueError("'any' needs at least one tool in tools")
        return value

    @property
    def parallel_tool_calls(self) -> bool:
        return not (self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use)

    def tool_names(self) -> set[str]:
        """The tools whose calls the reply is parsed for (none when tool_choice is 'none')."""
        off = not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none")
        return set() if off else {t.name for t in self.tools or []}

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.to_openai() for t in self.tools] if self.tools else None

    def forced_tools(self) -> list[tuple[str, dict[str, Any] | None]] | None:
        """(name, input_schema) of the tools one of which must be called ('any' or a named 'tool')."""
        choice = self.tool_choice
        if choice is None or choice.type not in ("any", "tool"):
            return None
        return [(t.name, t.input_schema) for t in self.tools or [] if choice.type == "any" or t.name == choice.name]

    def to_template(self) -> list[dict[str, Any]]:
        """The conversation as chat-template messages; `system` leads as a system message."""
        out = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        return out + [msg for m in self.messages for msg in m.to_template()]


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    """A parsed call as Anthropic's `tool_use` content block (`toolu_` id, `input` an object)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


class MessagesRenderer(Renderer):
    prefix = "msg"
    req: MessagesRequest

    def __init__(self, state: Any, req: MessagesRequest, prompts: list[list[int]]):
        super().__init__(state, req, prompts)
        self.tool_names = req.tool_names()
        self.num_calls = 0

    def _stop(self, choice: Choice) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence) in Anthropic's terms."""
        if choice.finish_reason == "length":
            return "max_tokens", None
        if choice.finish_reason == "stop" and self.num_calls:
            return "tool_use", None
        if choice.finish_reason == "stop" and isinstance(choice.stop_reason, str):
            return "stop_sequence", choice.stop_reason
        return ("end_turn", None) if choice.finish_reason is not None else (None, None)

    def _usage(self) -> dict[str, int]:
        usage = self.usage()
        return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "cache_read_input_tokens": sum(self.num_cached.values())}

    def _message(self, content: list[dict[str, Any]], choice: Choice | None) -> dict[str, Any]:
        stop_reason, stop_sequence = self._stop(choice) if choice is not None else (None, None)
        return {"id": self.request_id, "type": "message", "role": "assistant", "model": self.state.model_name,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self._usage()}

    async def collect(self, stream: OutputStream) -> dict[str, Any]:
        async for batch in stream.batches():
            self.apply(batch)
        choice = self.ordered_choices()[0]
        if not self.tool_names:
            return self._message([{"type": "text", "text": choice.text}], choice)
        text, calls = parse_tool_calls(choice.text, self.tool_names, self.req.parallel_tool_calls)
        self.num_calls = len(calls)
        content = ([{"type": "text", "text": text}] if text or not calls else []) + [tool_use_block(c) for c in calls]
        return self._message(content, choice)

    async def sse(self, stream: OutputStream) -> AsyncIterator[str]:
        start = self._message([], None)
        start["usage"]["output_tokens"] = 0
        yield _event("message_start", {"type": "message_start", "message": start})
        blocks = _BlockWriter()
        tools = ToolCallStream(self.tool_names, self.req.parallel_tool_calls) if self.tool_names else None
        if tools is None:  # plain text: one text block, opened at once
            yield "".join(blocks.text(""))
        choice = self.ordered_choices()[0]
        try:
            async for batch in stream.batches():
                self.apply(batch)
                delta = choice.take_delta()
                pieces = [delta] if tools is None else tools.feed(delta)
                if tools is not None and choice.finish_reason is not None:
                    pieces += tools.finish()
                for piece in pieces:
                    if isinstance(piece, ToolCall):
                        self.num_calls += 1
                    events = blocks.text(piece) if isinstance(piece, str) else blocks.tool_use(piece)
                    if events:
                        yield "".join(events)
        except Exception as exc:  # noqa: BLE001 - the status line is already sent; report in-band
            yield _event("error", anthropic_error_body(500, str(exc)))
            return
        if blocks.index < 0:  # nothing was said: one empty text block, as Anthropic sends
            yield "".join(blocks.text(""))
        stop_reason, stop_sequence = self._stop(choice)
        for event in blocks.close():
            yield event
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                       "usage": {"output_tokens": self.usage().completion_tokens}})
        yield _event("message_stop", {"type": "message_stop"})


class _BlockWriter:
    """The content-block events of a streamed message: a text block stays open while text comes;
    a tool call closes it and is sent whole as its own tool_use block."""

    def __init__(self) -> None:
        self.index, self.open_type = -1, None

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index, self.open_type = self.index + 1, block["type"]
        return events + [_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                        "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def text(self, text: str) -> list[str]:
        events = self._start({"type": "text", "text": ""}) if self.open_type != "text" else []
        return events + ([self._delta({"type": "text_delta", "text": text})] if text else [])

    def tool_use(self, call: ToolCall) -> list[str]:
        block = tool_use_block(call)
        arguments = json.dumps(block["input"], ensure_ascii=False)
        events = self._start({**block, "input": {}})
        events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events + self.close()

    def close(self) -> list[str]:
        if self.open_type is None:
            return []
        self.open_type = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]
