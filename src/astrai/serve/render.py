"""Engine updates -> OpenAI responses: the choice accumulator and the two response renderers.

`app.py` turns a validated request into prompt token ids and a renderer over the server's
`RenderContext` (the served model's name, token texts); the renderer names the engine requests
(one per prompt), folds `RequestUpdate`s from the async engine loop into one
`Choice` per (prompt, sample) and renders either the final JSON body or the SSE chunks. Chat
and legacy completions differ only in chunk shape, echo and logprob format, so they share the
accumulator and the SSE skeleton: a first chunk (role or echo), one chunk per batch of ready
updates with the text delta of each changed choice, exactly one finish_reason per choice, an
optional usage chunk with empty `choices`, then `data: [DONE]`. vLLM's token-in/token-out fields
ride along when asked for (`return_token_ids`: the prompt's ids in the body or a choice's first
chunk, each chunk's new ids; completions' `prompt_logprobs`), and every body and every chunk
after the first engine update names the `policy_version` of the weights that produced it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from astrai.data.tool_calls import ToolCall, ToolCallStream, parse_tool_calls
from astrai.serve.async_engine import OutputStream, RequestUpdate
from astrai.serve.protocol import ChatCompletionRequest, CompletionRequest
from astrai.serve.responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    Usage,
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    error_body,
    make_usage,
    prompt_logprobs_entries,
)

DONE = "data: [DONE]\n\n"


class RenderContext(Protocol):
    """What a renderer reads of the server (`state.ServerState` satisfies it)."""

    model_name: str  # the id responses name

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (logprob entries)."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """A prompt's text, special tokens included (completions' echo of token-id prompts)."""
        ...


# Characters that some line-splitting SSE clients (JavaScript's, Python's str.splitlines) take as
# line ends; inside a JSON string they may be escaped, which keeps every event on one line.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})


def sse(obj: Any) -> str:
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)
    return "data: " + data + "\n\n"


class Choice:
    """Everything one sample (choice) has produced so far."""

    __slots__ = ("index", "prompt_index", "text", "num_text_sent", "token_ids", "logprobs",
                 "finish_reason", "stop_reason", "text_offset")

    def __init__(self, index: int, prompt_index: int):
        self.index, self.prompt_index = index, prompt_index
        self.text, self.num_text_sent = "", 0
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text_offset = 0

    def take_delta(self) -> str:
        delta = self.text[self.num_text_sent:]
        self.num_text_sent = len(self.text)
        return delta


class Renderer:
    """Shared skeleton; subclasses set `prefix` and render chunks and the final body."""

    prefix = "cmpl"

    def __init__(self, state: RenderContext, req: ChatCompletionRequest | CompletionRequest,
                 prompts: list[list[int]]):
        self.state, self.req, self.prompts = state, req, prompts
        self.request_id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.engine_ids = ([self.request_id] if len(prompts) == 1 else
                           [f"{self.request_id}-{p}" for p in range(len(prompts))])
        n = req.n
        self.choices = {(rid, i): Choice(p * n + i, p) for p, rid in enumerate(self.engine_ids) for i in range(n)}
        self.num_cached = dict.fromkeys(self.engine_ids, 0)
        self.prompt_logprobs: dict[str, list[Any]] = {}  # engine request id -> entries, when asked for
        self.include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        self.return_ids = bool(getattr(req, "return_token_ids", False))  # Anthropic's route has none
        self.policy_version: int | None = None  # of the engine updates so far (all the same: serve/async_engine.py)

    def engine_requests(self) -> list[tuple[str, list[int]]]:
        return list(zip(self.engine_ids, self.prompts))

    def apply(self, batch: list[RequestUpdate]) -> list[tuple[Choice, list[int], list[Any], bool]]:
        """Fold a batch of updates in; per changed choice: (choice, new ids, new logprobs, finished now)."""
        changed: dict[int, tuple[Choice, list[int], list[Any], list[bool]]] = {}
        for update in batch:
            self.policy_version = update.policy_version
            self.num_cached[update.request_id] = max(self.num_cached[update.request_id], update.num_cached_tokens)
            if update.prompt_logprobs is not None:
                self.prompt_logprobs[update.request_id] = update.prompt_logprobs
            for seq in update.outputs:
                choice = self.choices[(update.request_id, seq.index)]
                _, new_ids, new_lps, finished = changed.setdefault(choice.index, (choice, [], [], [False]))
                if seq.new_token_ids or seq.finish_reason != "abort":  # an abort carries no text
                    choice.text = seq.text
                choice.token_ids += seq.new_token_ids
                new_ids += seq.new_token_ids
                if seq.new_logprobs:
                    choice.logprobs += seq.new_logprobs
                    new_lps += seq.new_logprobs
                if seq.finish_reason and choice.finish_reason is None:
                    choice.finish_reason, choice.stop_reason = seq.finish_reason, seq.stop_reason
                    finished[0] = True
        return [(c, ids, lps, fin[0]) for c, ids, lps, fin in (changed[k] for k in sorted(changed))]

    def usage(self) -> Usage:
        return make_usage(sum(len(p) for p in self.prompts), sum(len(c.token_ids) for c in self.choices.values()),
                          sum(self.num_cached.values()))

    def ordered_choices(self) -> list[Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    async def collect(self, stream: OutputStream) -> dict[str, Any]:
        async for batch in stream.batches():
            self.apply(batch)
        return self.response().model_dump()

    async def sse(self, stream: OutputStream) -> AsyncIterator[str]:
        for chunk in self.first_chunks():
            yield sse(chunk)
        try:
            async for batch in stream.batches():
                rendered = [self.chunk_choice(*change) for change in self.apply(batch)]
                choices = [c for c in rendered if c is not None]
                if choices:
                    yield sse(self.versioned(self.chunk(choices)))
        except Exception as exc:  # noqa: BLE001 - the status line is already sent; report in-band
            yield sse(error_body(str(exc), "internal_error"))
            yield DONE
            return
        if self.include_usage:
            yield sse(self.versioned(self.chunk([], self.usage())))
        yield DONE

    def versioned(self, chunk: dict[str, Any]) -> dict[str, Any]:
        chunk["policy_version"] = self.policy_version
        return chunk

    # ---- per endpoint -------------------------------------------------------------------
    def first_chunks(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def chunk_choice(self, choice: Choice, new_ids: list[int], new_lps: list[Any],
                     finished_now: bool) -> dict[str, Any] | None:
        raise NotImplementedError

    def chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def response(self) -> Any:
        raise NotImplementedError


class ChatRenderer(Renderer):
    prefix = "chatcmpl"
    req: ChatCompletionRequest

    def __init__(self, state: RenderContext, req: ChatCompletionRequest, prompts: list[list[int]]):
        super().__init__(state, req, prompts)
        # with tools offered (and not switched off), each choice's text is split into content and calls
        self.tool_names = req.tool_names() if req.effective_tool_choice() != "none" else set()
        self.tool_streams = {c.index: ToolCallStream(self.tool_names, req.parallel_tool_calls)
                             for c in self.choices.values()} if self.tool_names else {}
        self.num_calls_sent: dict[int, int] = {}

    def _logprobs(self, ids: list[int], entries: list[Any]) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(ids, entries, self.req.top_logprobs or 0, self.state.token_text)

    def _finish_reason(self, choice: Choice, made_calls: bool) -> str | None:
        return "tool_calls" if made_calls and choice.finish_reason == "stop" else choice.finish_reason

    def first_chunks(self) -> list[dict[str, Any]]:
        role = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for c in self.ordered_choices()]
        chunk = self.chunk(role)
        if self.return_ids:
            chunk["prompt_token_ids"] = self.prompts[0]
        return [chunk]

    def chunk_choice(self, choice: Choice, new_ids: list[int], new_lps: list[Any],
                     finished_now: bool) -> dict[str, Any] | None:
        text = choice.take_delta()
        calls: list[ToolCall] = []
        tools = self.tool_streams.get(choice.index)
        if tools is not None:  # calls are released whole; text that may open one is held back
            pieces = tools.feed(text) + (tools.finish() if finished_now else [])
            text = "".join(p for p in pieces if isinstance(p, str))
            calls = [p for p in pieces if isinstance(p, ToolCall)]
        logprobs = self._logprobs(new_ids, new_lps) if new_ids else None
        if not text and not calls and logprobs is None and not finished_now and not (self.return_ids and new_ids):
            return None
        delta: dict[str, Any] = {"content": text} if text or logprobs else {}
        if calls:
            first = self.num_calls_sent.get(choice.index, 0)
            delta["tool_calls"] = [{"index": first + i, **call.to_openai()} for i, call in enumerate(calls)]
            self.num_calls_sent[choice.index] = first + len(calls)
        made_calls = self.num_calls_sent.get(choice.index, 0) > 0
        out = {"index": choice.index, "delta": delta, "logprobs": logprobs,
               "finish_reason": self._finish_reason(choice, made_calls) if finished_now else None}
        if self.return_ids:
            out["token_ids"] = new_ids
        return out

    def chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        return chat_chunk(self.request_id, self.created, self.state.model_name, choices, usage, self.include_usage)

    def response(self) -> ChatCompletionResponse:
        choices = []
        for c in self.ordered_choices():
            content: str | None = c.text
            calls: list[ToolCall] = []
            if self.tool_names:
                content, calls = parse_tool_calls(c.text, self.tool_names, self.req.parallel_tool_calls)
            message = ChatResponseMessage(content=content if content or not calls else None,
                                          tool_calls=[call.to_openai() for call in calls] or None)
            choices.append(ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c.token_ids, c.logprobs),
                                      finish_reason=self._finish_reason(c, bool(calls)), stop_reason=c.stop_reason,
                                      token_ids=c.token_ids if self.return_ids else None))
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.state.model_name,
                                      choices=choices, usage=self.usage(),
                                      prompt_token_ids=self.prompts[0] if self.return_ids else None,
                                      policy_version=self.policy_version)


class CompletionRenderer(Renderer):
    prefix = "cmpl"
    req: CompletionRequest

    def __init__(self, state: RenderContext, req: CompletionRequest, prompts: list[list[int]]):
        super().__init__(state, req, prompts)
        self.echo: list[str] = []
        self.echo_pending: set[int] = set()  # streamed choices whose echo waits for prompt log-probs
        self.prompt_sent: set[int] = set()  # streamed choices whose first chunk (prompt ids) went out
        if req.echo:
            given = req.prompt_list()
            self.echo = [p if isinstance(p, str) else state.decode(ids)
                         for p, ids in zip(given, prompts)]
            for choice in self.choices.values():
                choice.text_offset = len(self.echo[choice.prompt_index])

    @property
    def echo_logprobs(self) -> bool:
        """echo with logprobs: the prompt's tokens lead the logprobs (the engine computes them)."""
        return bool(self.echo) and self.req.logprobs is not None

    def _logprobs(self, choice: Choice, ids: list[int], entries: list[Any]) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        out = completion_logprobs(ids, entries, self.req.logprobs, self.state.token_text, choice.text_offset)
        choice.text_offset += sum(len(t) for t in out["tokens"])
        return out

    def _with_prompt(self, choice: Choice, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """The prompt's logprobs (offsets from 0), then `logprobs` of the generated tokens."""
        ids = self.prompts[choice.prompt_index]
        entries = self.prompt_logprobs.get(self.engine_ids[choice.prompt_index]) or [None] * len(ids)
        out = completion_logprobs(ids, entries, self.req.logprobs, self.state.token_text, 0)
        for key, values in (logprobs or {}).items():
            out[key] = out[key] + values
        return out

    def first_chunks(self) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        if self.echo_logprobs:  # sent with the first update, which carries the prompt log-probs
            self.echo_pending = {c.index for c in self.choices.values()}
            return []
        return [self.chunk([self._first({"index": c.index, "text": self.echo[c.prompt_index], "logprobs": None,
                                         "finish_reason": None}, c) for c in self.ordered_choices()])]

    def _prompt_logprobs(self, choice: Choice) -> list[Any] | None:
        entries = self.prompt_logprobs.get(self.engine_ids[choice.prompt_index])
        if self.req.prompt_logprobs is None or entries is None:
            return None
        return prompt_logprobs_entries(entries, self.state.token_text)

    def _first(self, out: dict[str, Any], choice: Choice) -> dict[str, Any]:
        """A streamed choice's first chunk: the prompt's ids and log-probs, when asked for."""
        if choice.index in self.prompt_sent:
            return out
        self.prompt_sent.add(choice.index)
        if self.return_ids:
            out["prompt_token_ids"] = self.prompts[choice.prompt_index]
        if self.req.prompt_logprobs is not None:
            out["prompt_logprobs"] = self._prompt_logprobs(choice)
        return out

    def chunk_choice(self, choice: Choice, new_ids: list[int], new_lps: list[Any],
                     finished_now: bool) -> dict[str, Any] | None:
        delta = choice.take_delta()
        logprobs = self._logprobs(choice, new_ids, new_lps) if new_ids else None
        if choice.index in self.echo_pending:
            self.echo_pending.discard(choice.index)
            delta = self.echo[choice.prompt_index] + delta
            logprobs = self._with_prompt(choice, logprobs)
        if not delta and logprobs is None and not finished_now and not (self.return_ids and new_ids):
            return None
        out = {"index": choice.index, "text": delta, "logprobs": logprobs,
               "finish_reason": choice.finish_reason if finished_now else None}
        if self.return_ids:
            out["token_ids"] = new_ids
        return self._first(out, choice)

    def chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        return completion_chunk(self.request_id, self.created, self.state.model_name, choices, usage,
                                self.include_usage)

    def response(self) -> CompletionResponse:
        choices = []
        for c in self.ordered_choices():
            prefix = self.echo[c.prompt_index] if self.echo else ""
            c.text_offset = len(prefix)
            logprobs = self._logprobs(c, c.token_ids, c.logprobs)
            if self.echo_logprobs:
                logprobs = self._with_prompt(c, logprobs)
            choices.append(CompletionChoice(
                index=c.index, text=prefix + c.text, logprobs=logprobs, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason, prompt_token_ids=self.prompts[c.prompt_index] if self.return_ids else None,
                token_ids=c.token_ids if self.return_ids else None, prompt_logprobs=self._prompt_logprobs(c)))
        return CompletionResponse(id=self.request_id, created=self.created, model=self.state.model_name,
                                  choices=choices, usage=self.usage(), policy_version=self.policy_version)
