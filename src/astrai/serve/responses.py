"""OpenAI response shapes for the HTTP server: bodies, streaming chunks, usage, errors, logprobs.

The renderers (`serve/render.py`) write engine outputs back into these shapes; `generate.py` reads
the logprob helpers for its own per-token output. Non-streaming bodies are pydantic models;
streaming chunks are plain dicts, because they are on the per-token hot path. Logprobs are
floored at `MIN_LOGPROB` (vLLM's bound: a token removed by top-p/top-k has logprob -inf, which is
not valid JSON).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

MIN_LOGPROB = -9999.0


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    policy_version: int | None = None  # astrai's: the weights that produced every choice


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # with prompt_logprobs


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    policy_version: int | None = None  # astrai's: the weights that produced every choice


def make_usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> Usage:
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                 total_tokens=num_prompt_tokens + num_completion_tokens,
                 prompt_tokens_details={"cached_tokens": num_cached_tokens})


def chat_chunk(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
               usage: Usage | None = None, with_usage_field: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": choices}
    if with_usage_field:
        chunk["usage"] = usage.model_dump() if usage is not None else None
    return chunk


def completion_chunk(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                     usage: Usage | None = None, with_usage_field: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created,
                             "model": model, "choices": choices}
    if with_usage_field:
        chunk["usage"] = usage.model_dump() if usage is not None else None
    return chunk


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code)).model_dump()


# ----------------------------------------------------------------------------- logprobs
def logprob_value(entry: Any, token_id: int) -> float:
    """The chosen token's logprob from an engine entry: a float or a {token_id: Logprob} dict."""
    if isinstance(entry, dict):
        entry = entry.get(token_id)
    value = getattr(entry, "logprob", entry)
    return max(float(value), MIN_LOGPROB) if value is not None else MIN_LOGPROB


def top_alternatives(entry: Any, k: int) -> list[tuple[int, float]]:
    """The k most likely (token_id, logprob) of an engine entry, most likely first."""
    if not isinstance(entry, dict) or k <= 0:
        return []
    ranked = sorted(entry.items(), key=lambda kv: (getattr(kv[1], "rank", 0), -logprob_value(kv[1], kv[0])))
    return [(tid, logprob_value(lp, tid)) for tid, lp in ranked[:k]]


def chat_logprobs(token_ids: list[int], entries: list[Any], k: int,
                  token_text: Any) -> dict[str, list[dict[str, Any]]]:
    """OpenAI chat `logprobs.content` for tokens; `token_text(id) -> str` decodes one token."""
    content = []
    for tid, entry in zip(token_ids, entries):
        text = token_text(tid)
        content.append({
            "token": text, "logprob": logprob_value(entry, tid), "bytes": list(text.encode()),
            "top_logprobs": [{"token": token_text(a), "logprob": lp, "bytes": list(token_text(a).encode())}
                             for a, lp in top_alternatives(entry, k)]})
    return {"content": content}


def prompt_logprobs_entries(entries: list[Any], token_text: Any) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a completion choice: None for the first prompt token (nothing
    predicts it), then per token `{token_id: {"logprob", "rank", "decoded_token"}}`: the prompt's
    own token first, then the k most likely alternatives (the engine's entry as it is)."""
    return [{str(tid): {"logprob": logprob_value(lp, tid), "rank": getattr(lp, "rank", None),
                        "decoded_token": token_text(tid)} for tid, lp in entry.items()}
            if isinstance(entry, dict) else None for entry in entries]


def completion_logprobs(token_ids: list[int], entries: list[Any], k: int, token_text: Any,
                        text_offset: int) -> dict[str, list[Any]]:
    """OpenAI legacy completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset).
    An entry of None (the first token of an echoed prompt, which nothing predicts) gives null
    token_logprobs and top_logprobs."""
    tokens, values, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        text = token_text(tid)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(logprob_value(entry, tid))
        # like vLLM: the chosen token is listed too, even when it is not among the top k
        top = {token_text(a): lp for a, lp in top_alternatives(entry, k)}
        top.setdefault(text, values[-1])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
