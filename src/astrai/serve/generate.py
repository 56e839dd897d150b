"""The token-in routes: vLLM's `POST /inference/v1/generate` (its request schema and renderer) and
prime-rl's `POST /v1/chat/completions/tokens` (a chat completion whose prompt comes as ids).

The route an RL client calls when it renders prompts itself (verifiers' renderer client, prime-rl):
`{"token_ids": [...], "sampling_params": {...vLLM's SamplingParams names...}, "model"?, "stream"?,
"request_id"?}` in, `{"request_id", "choices": [{"index", "token_ids", "logprobs", "finish_reason"}],
"prompt_logprobs", "usage", ...}` out, nothing decoded or re-encoded on the way (vLLM's shapes:
`logprobs.content[i].token` is `"token_id:<id>"`, so a client never parses token text). `app.py`
serves it through the same skeleton as the OpenAI routes (`_serve`: auth, limits, the engine loop,
disconnects); this module says how the request becomes prompt ids and `SamplingParams`, and how
engine updates become its body or its SSE chunks. Like every astrai answer, the body and each chunk
after the first engine update carry `policy_version`; `logprobs_mode` (astrai's, top level) picks the
sampler's behaviour log-probs (`processed_logprobs`) over the raw model's (the default, as vLLM's
server default).

`/v1/chat/completions/tokens` is the route verifiers 0.3's training client posts a later turn of a
multi-turn rollout to: the chat completion body (`messages`, `tools`, sampling, `logprobs`,
`return_token_ids`) plus `tokens`, the prompt's ids, which the client stitched from the previous turn's
prompt and completion ids and the ids the template adds for the new messages (from `/tokenize`), so
the sampled ids are never decoded and re-encoded. The ids are the prompt; `messages` and `tools` are
read only as on `/v1/chat/completions` after rendering (tool calls in the reply, `tool_choice` and
`response_format` constraints), and the answer is a chat completion in every way.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from astrai.infer.sampling import SamplingParams
from astrai.serve.protocol import (
    ChatCompletionRequest,
    SamplingKnobs,
    StreamOptions,
    StrictModel,
    sampling_field,
)
from astrai.serve.render import Choice, RenderContext, Renderer
from astrai.serve.requests import APIError
from astrai.serve.responses import logprob_value, prompt_logprobs_entries, top_alternatives
from astrai.serve.state import ServerState

ROUTE = "/inference/v1/generate"
CHAT_TOKENS_ROUTE = "/v1/chat/completions/tokens"


class GenerateSampling(SamplingKnobs):
    """`sampling_params` of a generate request: vLLM's SamplingParams names, SamplingParams' bounds."""

    max_tokens: int = sampling_field("max_tokens", 16)  # vLLM's SamplingParams default
    logprobs: int | None = sampling_field("logprobs")  # k alternatives per generated token
    prompt_logprobs: int | None = sampling_field("prompt_logprobs")
    # the answer holds no text, so how text would be decoded changes nothing: accepted as no-ops
    detokenize: bool = True
    skip_special_tokens: bool = True


class GenerateRequest(StrictModel):
    """vLLM's GenerateRequest (the fields astrai acts on; the others are accepted and logged as ignored)."""

    token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    model: str | None = None  # checked when given
    request_id: str | None = None  # echoed in the answer; astrai's engine ids stay its own
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"  # astrai's

    @property
    def n(self) -> int:  # what the shared renderer skeleton reads
        return self.sampling_params.n


def checked_ids(state: ServerState, ids: list[int], max_tokens: int | None, param: str) -> list[list[int]]:
    """The one prompt, its ids inside the vocabulary and, with max_tokens, inside max_model_len."""
    bad = [t for t in ids if t >= state.vocab_size]
    if bad:
        raise APIError(400, f"{param} holds {bad[0]}, outside the vocabulary (ids 0..{state.vocab_size - 1}); "
                            "send ids of this model's tokenizer", param=param)
    state.check_length(len(ids), max_tokens, param)
    return [list(ids)]


async def generate_prompts(state: ServerState, req: GenerateRequest) -> list[list[int]]:
    return checked_ids(state, req.token_ids, req.sampling_params.max_tokens, "token_ids")


class ChatTokensRequest(ChatCompletionRequest):
    """prime-rl's `/v1/chat/completions/tokens` body: a chat completion request and its prompt's ids."""

    tokens: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)


async def chat_tokens_prompts(state: ServerState, req: ChatTokensRequest) -> list[list[int]]:
    return checked_ids(state, req.tokens, req.requested_max_tokens(), "tokens")


def generate_params(state: ServerState, req: GenerateRequest) -> SamplingParams:
    """Read as the OpenAI routes' fields are (the model's defaults where the request is silent);
    `logprobs` and `prompt_logprobs` keep vLLM's meaning here, k alternatives each."""
    sampling = req.sampling_params
    return state.sampling_params(sampling, logprobs=sampling.logprobs, prompt_logprobs=sampling.prompt_logprobs)


def tokens_logprobs(token_ids: list[int], entries: list[Any], k: int) -> dict[str, list[dict[str, Any]]]:
    """vLLM's generate `logprobs`: chat's `content` list, each token named `token_id:<id>`."""
    return {"content": [{"token": f"token_id:{tid}", "logprob": logprob_value(entry, tid), "bytes": None,
                         "top_logprobs": [{"token": f"token_id:{a}", "logprob": lp, "bytes": None}
                                          for a, lp in top_alternatives(entry, k)]}
                        for tid, entry in zip(token_ids, entries)]}


class GenerateChoice(BaseModel):
    index: int
    token_ids: list[int]
    logprobs: dict[str, Any] | None = None
    finish_reason: str


class GenerateResponse(BaseModel):
    request_id: str
    created: int
    model: str
    choices: list[GenerateChoice]
    usage: dict[str, Any]
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    kv_transfer_params: None = None  # vLLM's disaggregated-serving field; astrai has none
    policy_version: int | None = None  # astrai's: the weights that produced every choice


class GenerateRenderer(Renderer):
    """Engine updates -> vLLM's GenerateResponse, or its stream chunks (one per batch of updates)."""

    prefix = "gen"
    req: GenerateRequest

    def __init__(self, state: RenderContext, req: GenerateRequest, prompts: list[list[int]]):
        super().__init__(state, req, prompts)
        self.response_id = req.request_id or self.request_id
        self.k = req.sampling_params.logprobs

    def _logprobs(self, ids: list[int], entries: list[Any]) -> dict[str, Any] | None:
        return tokens_logprobs(ids, entries, self.k) if self.k is not None else None

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    def chunk_choice(self, choice: Choice, new_ids: list[int], new_lps: list[Any],
                     finished_now: bool) -> dict[str, Any] | None:
        if not new_ids and not finished_now:
            return None
        return {"index": choice.index, "token_ids": new_ids, "logprobs": self._logprobs(new_ids, new_lps),
                "finish_reason": choice.finish_reason if finished_now else None}

    def chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        out: dict[str, Any] = {"request_id": self.response_id, "choices": choices}
        if usage is not None:
            out["usage"] = usage.model_dump()
        return out

    def response(self) -> GenerateResponse:
        entries = self.prompt_logprobs.get(self.engine_ids[0])
        choices = [GenerateChoice(index=c.index, token_ids=c.token_ids, logprobs=self._logprobs(c.token_ids, c.logprobs),
                                  finish_reason=c.finish_reason or "stop") for c in self.ordered_choices()]
        return GenerateResponse(
            request_id=self.response_id, created=self.created, model=self.state.model_name, choices=choices,
            usage=self.usage().model_dump(), prompt_token_ids=self.prompts[0], policy_version=self.policy_version,
            prompt_logprobs=prompt_logprobs_entries(entries, self.state.token_text)
            if self.req.sampling_params.prompt_logprobs is not None and entries is not None else None)
