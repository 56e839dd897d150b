"""Reading a request, from HTTP body to prompt token ids and SamplingParams, and the error a client
gets when it fails.

The first steps of a request in `app.py`'s routes: the body within `--body_timeout` seconds
(408) and `--max_request_bytes` (413), JSON no deeper than MAX_JSON_DEPTH (422), with no lone
UTF-16 surrogate and, for a chat, no more messages than max_model_len (400), the pydantic
request of `protocol.py` / `anthropic.py` (400 naming the parameter), then the chat template or
the tokenizer turning it into prompt token ids (a template error is the client's, 400), the
grammar a constrained chat request's output must follow (`infer/guided.py`), and the request's
`SamplingParams`: every field is read from the request field of the same name, except the few
that OpenAI spells its own way (`RENAMED`). Every failure is an `APIError`, answered with
OpenAI's error body (Anthropic's on /v1/messages) before the request reaches the engine. Parsing
and rendering run on the server's prep pool, not here.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from astrai.infer.guided import Guide, GuideCompiler, GuideError
from astrai.infer.sampling import SamplingParams
from astrai.serve.anthropic import MessagesRequest, anthropic_error_body
from astrai.serve.protocol import ChatCompletionRequest, CompletionRequest, shown_name
from astrai.serve.responses import error_body

MAX_JSON_DEPTH = 64  # deeper bodies are refused (422) before pydantic or a template recurses into them


class APIError(Exception):
    """An error answered with OpenAI's body `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers

    def response(self, anthropic: bool = False) -> JSONResponse:
        body = (anthropic_error_body(self.status, self.message) if anthropic
                else error_body(self.message, self.type, self.param, self.code))
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client disconnected before its request body arrived; nobody is left to answer."""


def param_named_in(message: str) -> str | None:
    """The SamplingParams field a ValueError message names (the error body's `param`), or None."""
    match = re.search(r"SamplingParams\.(\w+)", message)
    return match.group(1) if match else None


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, within `timeout` seconds in all (408) and `limit` bytes (413), whatever the
    Content-Length header claims."""
    declared = request.headers.get("content-length", "")
    too_large = declared.isdigit() and int(declared) > limit
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                if not too_large:
                    body += chunk
                    too_large = len(body) > limit
                # past the limit the rest is read and dropped, so the client gets our 413, not a reset
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} seconds "
                            f"({len(body)} bytes received); send it faster or raise --body_timeout",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone(f"client disconnected after sending {len(body)} of "
                         f"{declared or 'an unknown number of'} body bytes") from None
    if too_large:
        raise APIError(413, f"request body is larger than the limit of {limit} bytes; send a smaller "
                            "request or raise --max_request_bytes", code="request_too_large")
    return bytes(body)


def parse_request(body: bytes, model: type, max_messages: int | None = None) -> Any:
    """JSON -> pydantic (on the prep pool): 422 for malformed or too deeply nested JSON, 400 for bad
    values, for a lone UTF-16 surrogate in any string (it has no UTF-8 form, so no tokenizer,
    template or response could carry it), and for more `messages` than `max_messages` (counted
    before validation, whose cost grows with the count and holds the interpreter lock)."""
    try:
        data = json.loads(body)
    except RecursionError:
        data = None
        depth = MAX_JSON_DEPTH + 1
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(422, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    else:
        depth = _json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise APIError(422, f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels; flatten it",
                       code="invalid_json")
    if _SURROGATE.search(body):  # a cheap look at the bytes first: the walk is for suspects only
        where = _surrogate_at(data)
        if where is not None:
            where = shown_name(where)
            raise APIError(400, f"'{where or 'the body'}' holds a lone UTF-16 surrogate (a \\ud800-\\udfff "
                                "escape without its pair), which is not Unicode text; send valid UTF-8",
                           param=where or None)
    messages = data.get("messages") if isinstance(data, dict) else None
    if max_messages is not None and isinstance(messages, list) and len(messages) > max_messages:
        raise APIError(400, f"'messages' has {len(messages)} entries but max_model_len is {max_messages} tokens "
                            f"and every message renders to at least one; send at most {max_messages} messages",
                       param="messages")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _loc_to_param(first.get("loc", ()))
        where = f"'{param}': " if param else ""
        raise APIError(400, f"invalid value for {where}{first['msg']} (got {_short(first.get('input'))})",
                       param=param) from None


# a \uD800-\uDFFF escape (even a paired one: the walk decides) or raw surrogate bytes (CESU-8)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _surrogate_at(data: Any) -> str | None:
    """The dotted path of the first string (key or value) holding a lone surrogate, or None."""
    todo: list[tuple[Any, str]] = [(data, "")]
    while todo:
        node, path = todo.pop()
        if isinstance(node, str):
            if not node.isascii() and not _is_unicode(node):
                return path
        elif isinstance(node, dict):
            for key, value in node.items():
                if not _is_unicode(key):
                    return path
                todo.append((value, f"{path}.{key}" if path else key))
        elif isinstance(node, list):
            todo.extend((item, f"{path}[{i}]") for i, item in enumerate(node))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_depth(data: Any) -> int:
    """Nesting depth of parsed JSON, walked without recursion; stops once past MAX_JSON_DEPTH."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                break
            children = node.values() if isinstance(node, dict) else node
            todo.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


_TYPE_TAGS = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-after\[.*\])$")


def _loc_to_param(loc: tuple) -> str | None:
    parts = ""
    for item in loc:
        if isinstance(item, int):
            parts += f"[{item}]"
        elif not _TYPE_TAGS.match(str(item)):  # union branch tags are not parameter names
            parts += ("." if parts else "") + str(item)
    return parts or None


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ------------------------------------------------------------------------------- prompt token ids
def render_chat(tokenizer: Any, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                check_chars: Callable[[int, str], None]) -> list[int]:
    """A conversation (chat-template messages, OpenAI's or Anthropic's made into them) and the
    template's `tools` -> prompt token ids, on the prep pool. The rendered text is bounded by
    `check_chars` (an `APIError` when too long) before it is tokenised: empty messages cost no
    content but each still renders its role markers."""
    num_chars = sum(len(m.get("content") or "") for m in conversation)
    check_chars(num_chars + (len(json.dumps(tools, ensure_ascii=False)) if tools else 0), "messages")
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, tools=tools)
    except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the client's
        raise APIError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None
    check_chars(len(text), "messages")
    return tokenizer.encode(text, add_special_tokens=False)


def encode_prompts(tokenizer: Any, prompts: list[str | list[int]]) -> list[list[int]]:
    """Text prompts -> token ids (on the prep pool); token-id prompts pass through."""
    return [tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else p for p in prompts]


# ------------------------------------------------------------------------------- sampling
SamplingRequest = ChatCompletionRequest | CompletionRequest | MessagesRequest

# The SamplingParams fields a request spells its own way (`renamed_fields` reads them): chat's
# max_completion_tokens and its logprobs flag with top_logprobs, the stop list (Anthropic's
# stop_sequences; empty strings dropped), completions' echo with logprobs, and the grammar. Every
# other field comes from the request field of the same name (OpenAI's, or an extra_body one such
# as top_k, min_p or repetition_penalty) when the request declares it and sets it.
RENAMED = ("max_tokens", "stop", "logprobs", "prompt_logprobs", "guide")
SAME_NAMED = tuple(f.name for f in fields(SamplingParams) if f.name not in RENAMED)


def renamed_fields(req: SamplingRequest) -> dict[str, Any]:
    """The RENAMED SamplingParams fields of a request (all but `guide`, which `grammar_guide` makes)."""
    out: dict[str, Any] = {"max_tokens": req.max_tokens, "stop": req.stop_list() or None, "logprobs": None}
    if isinstance(req, ChatCompletionRequest):
        out["max_tokens"] = req.requested_max_tokens()
        out["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    elif isinstance(req, CompletionRequest):
        out["logprobs"] = req.logprobs
        # echo with logprobs: the prompt's tokens get log-probs too (computed by the engine); vLLM's
        # prompt_logprobs asks for them alone; both: the larger k serves both
        echoed = req.logprobs if req.echo and req.logprobs is not None else None
        asked = [k for k in (echoed, req.prompt_logprobs) if k is not None]
        out["prompt_logprobs"] = max(asked) if asked else None
    return out


def to_sampling_params(req: SamplingRequest, defaults: dict[str, Any], vocab_size: int,
                       **renamed: Any) -> SamplingParams:
    """The request's SamplingParams: `defaults` (the model's generation_config.json) where the
    request is silent, then its same-named fields, then `renamed_fields`, then `renamed` (the
    guide). A value SamplingParams refuses is a 400 naming the field."""
    declared = type(req).model_fields
    kwargs = dict(defaults)
    kwargs.update({name: getattr(req, name) for name in SAME_NAMED
                   if name in declared and getattr(req, name) is not None})
    kwargs.update(renamed_fields(req))
    kwargs.update(renamed)
    try:
        params = SamplingParams(**kwargs)
        params.check_vocab(vocab_size)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param_named_in(str(exc))) from None
    return params


def grammar_guide(req: ChatCompletionRequest | MessagesRequest,
                  compiler: Callable[[], GuideCompiler]) -> Guide | None:
    """The grammar a chat or Anthropic request's output must follow (on the prep pool), or None:
    a JSON response_format, or the tool calls of `forced_tools` (OpenAI's tool_choice 'required' or
    a named function; Anthropic's 'any' or a named tool)."""
    fmt, forced = req.response_format, req.forced_tools()
    if (fmt is None or fmt.type == "text") and forced is None:
        return None
    try:
        guides = compiler()
        if fmt is not None and fmt.type == "json_object":
            return guides.json_object()
        if fmt is not None and fmt.type == "json_schema":
            return guides.json_schema(fmt.json_schema.schema_)
        return guides.tool_calls([(name, rooted(name, params)) for name, params in forced or []],
                                 req.parallel_tool_calls)
    except GuideError as exc:
        raise APIError(400, str(exc), param="response_format" if forced is None else "tools") from None


def rooted(name: str, schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tool's parameter schema made its own JSON-pointer root: the tool-call grammar nests it
    inside a wrapper object, where its `#/$defs/...` references would point into the wrapper. A
    `$id` makes `#` resolve to the schema itself again (JSON Schema's base-URI rule)."""
    if not isinstance(schema, dict) or "$id" in schema or "$ref" not in json.dumps(schema):
        return schema
    return {"$id": f"urn:astrai:tool:{name}", **schema}
