"""Anthropic Messages API (`POST /v1/messages`): request schema, error body and renderer.

The route in `app.py` validates the body against `MessagesRequest`, renders the conversation
through the same chat template as `/v1/chat/completions` (the `system` field becomes a leading
system message) and submits it to the same engine. `MessagesRenderer` reuses the choice
accumulator of `render.py` and writes Anthropic's shapes: a `message` object with text content
blocks and `stop_reason`, or the SSE sequence `message_start`, `content_block_start`,
`content_block_delta`*, `content_block_stop`, `message_delta` (stop reason, output usage),
`message_stop`. Errors use Anthropic's body `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from astrai.serve.async_engine import OutputStream
from astrai.serve.protocol import _Strict
from astrai.serve.render import Renderer, _Choice

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
               422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class MessagesRequest(_Strict):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    # what the shared renderer skeleton reads (not fields: never taken from a request body)
    n: ClassVar[int] = 1
    stream_options: ClassVar[None] = None

    def stop_list(self) -> list[str]:
        return list(self.stop_sequences or [])

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty_stops(cls, value: list[str] | None) -> list[str] | None:
        if value and not all(value):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    def to_template(self) -> list[dict[str, Any]]:
        """The conversation as chat-template messages; `system` leads as a system message."""
        out = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        return out + [{"role": m.role, "content": m.text()} for m in self.messages]


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


class MessagesRenderer(Renderer):
    prefix = "msg"
    req: MessagesRequest

    def _stop(self, choice: _Choice) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence) in Anthropic's terms."""
        if choice.finish_reason == "length":
            return "max_tokens", None
        if choice.finish_reason == "stop" and isinstance(choice.stop_reason, str):
            return "stop_sequence", choice.stop_reason
        return ("end_turn", None) if choice.finish_reason is not None else (None, None)

    def _usage(self) -> dict[str, int]:
        usage = self.usage()
        return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "cache_read_input_tokens": sum(self.num_cached.values())}

    def _message(self, content: list[dict[str, Any]], choice: _Choice | None) -> dict[str, Any]:
        stop_reason, stop_sequence = self._stop(choice) if choice is not None else (None, None)
        return {"id": self.request_id, "type": "message", "role": "assistant", "model": self.state.model_name,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self._usage()}

    async def collect(self, stream: OutputStream) -> dict[str, Any]:
        async for batch in stream.batches():
            self.apply(batch)
        choice = self.ordered_choices()[0]
        return self._message([{"type": "text", "text": choice.text}], choice)

    async def sse(self, stream: OutputStream) -> AsyncIterator[str]:
        start = self._message([], None)
        start["usage"]["output_tokens"] = 0
        yield _event("message_start", {"type": "message_start", "message": start})
        yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}})
        choice = self.ordered_choices()[0]
        try:
            async for batch in stream.batches():
                self.apply(batch)
                delta = choice.take_delta()
                if delta:
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                         "delta": {"type": "text_delta", "text": delta}})
        except Exception as exc:  # noqa: BLE001 - the status line is already sent; report in-band
            yield _event("error", anthropic_error_body(500, str(exc)))
            return
        stop_reason, stop_sequence = self._stop(choice)
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                       "usage": {"output_tokens": self.usage().completion_tokens}})
        yield _event("message_stop", {"type": "message_stop"})
