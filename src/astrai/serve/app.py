"""`astrai serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn): the app and its routes.

Data flow: HTTP body -> size limit -> JSON -> pydantic request (`protocol.py`, `anthropic.py`) ->
prompt token ids (chat template or plain text) and `SamplingParams` (those steps are in
`requests.py`) -> `AsyncEngine.submit` (engine thread) -> `RequestUpdate`s -> OpenAI JSON or SSE
chunks (`render.py`). The three POST routes share one skeleton (`_serve`): each names only its
request model, how its prompts become checked token ids, and its renderer (`Endpoint`). At the
root, lm-eval's remote tokenizer routes (vLLM's `/tokenizer_info`, `/tokenize`, `/detokenize`:
`tokenizer_routes.py`) expose the served tokenizer, and vLLM's token-in/token-out `/inference/v1/generate` (`generate.py`)
takes the same skeleton, behind the same key and error bodies.
Everything a client can get wrong is answered with OpenAI's error body before the request reaches
the engine, so a bad request never touches the requests already running. What the routes share
(config, engine, limits, checks) is `state.py`'s `ServerState`. The model loads in the
background after the socket is bound: `/health` answers 503 until it is ready. The command line
(flags, uvicorn, graceful SIGTERM) is `cli.py`.

No one request may stall the others: the body must arrive within `--body_timeout` (408);
JSON parsing, template rendering and tokenisation run on a small thread pool, after a
character-count check that refuses a prompt too long to fit before encoding it (for a chat: its
message count before validation, its rendered text before tokenising); admission is bounded by
max_num_seqs plus `--max_waiting` (429 with Retry-After beyond it; 400 for a request with more
sequences than that, which could never be admitted).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from astrai.infer.guided import Guide
from astrai.infer.sampling import SamplingParams
from astrai.serve import admin, tokenizer_routes
from astrai.serve.admin import ADMIN_ROUTES
from astrai.serve.anthropic import MessagesRenderer, MessagesRequest
from astrai.serve.async_engine import AsyncEngine, Engine, EngineDeadError, OutputStream, QueueFullError
from astrai.serve.generate import (
    CHAT_TOKENS_ROUTE,
    ChatTokensRequest,
    GenerateRenderer,
    GenerateRequest,
    chat_tokens_prompts,
    generate_params,
    generate_prompts,
)
from astrai.serve.generate import ROUTE as GENERATE_ROUTE
from astrai.serve.metrics import ServerMetrics
from astrai.serve.protocol import ChatCompletionRequest, CompletionRequest
from astrai.serve.render import ChatRenderer, CompletionRenderer, Renderer
from astrai.serve.requests import (
    APIError,
    ClientGone,
    encode_prompts,
    grammar_guide,
    param_named_in,
    render_chat,
)
from astrai.serve.state import ServeConfig, ServerState, load_engine

logger = logging.getLogger("astrai.serve")
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/models", "/health", "/metrics",
          *tokenizer_routes.ROUTES, GENERATE_ROUTE, CHAT_TOKENS_ROUTE, "/openapi.json",
          *ADMIN_ROUTES)
ANTHROPIC_ROUTES = ("/v1/messages",)  # errors there use Anthropic's body
RETRY_AFTER_S = 1  # what a 429 tells the client to wait

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.serve


# ------------------------------------------------------------------------------- plain routes
@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> Response:
    state = _state(request)
    if state.status == "ready":
        return JSONResponse({"status": "ok"})
    return APIError(503, f"the model is {state.status}" + (f": {state.error}" if state.error else ""),
                    type_="service_unavailable").response()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = _state(request).metrics.render(request.headers.get("accept"))
    return Response(body, media_type=content_type)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state = _state(request)
    state.check_auth(request)
    engine = state.check_ready()
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "astrai",
            "max_model_len": state.max_model_len or None,
            "policy_version": getattr(engine.engine, "policy_version", 0)}  # astrai's: the weights served now
    return JSONResponse({"object": "list", "data": [card]})


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> Response:
    _state(request).check_auth(request)
    return JSONResponse(request.app.openapi())


# ------------------------------------------------------------------------------- the POST routes
@dataclass(frozen=True)
class Endpoint:
    """What differs between the POST routes; `_serve` is the rest."""

    request: type  # the pydantic request model
    prompts: Callable[[ServerState, Any], Awaitable[list[list[int]]]]  # checked prompt token ids
    renderer: Callable[[ServerState, Any, list[list[int]]], Renderer]
    want_logprobs: Callable[[Any], bool]
    constrained: bool = False  # the output may follow a grammar (requests.grammar_guide)
    # SamplingParams from a request whose sampling fields are not its own top-level ones (generate's)
    sampling: Callable[[ServerState, Any], SamplingParams] | None = None


async def _serve(endpoint: Endpoint, request: Request) -> Response:
    """auth -> ready -> body -> model -> prompt ids -> grammar -> SamplingParams -> engine -> response."""
    state = _state(request)
    state.check_auth(request)
    engine = state.check_ready()
    chat = issubclass(endpoint.request, (ChatCompletionRequest, MessagesRequest))  # a message renders to a token or more
    req = await state.read_request(request, endpoint.request, state.max_model_len if chat else None)
    if req.model is not None:  # required on the OpenAI routes, optional on generate
        state.check_model(req.model)
    prompts = await endpoint.prompts(state, req)
    guide: Guide | None = None
    if endpoint.constrained:
        guide = await state.off_loop(grammar_guide, req, state.guide_compiler)
    params = endpoint.sampling(state, req) if endpoint.sampling else state.sampling_params(req, guide=guide)
    _check_admissible(engine, prompts, params)
    renderer = endpoint.renderer(state, req, prompts)
    seeds = getattr(req, "seeds", None)  # completions: one seed per prompt
    per_prompt = [dataclasses.replace(params, seed=seed) for seed in seeds] if seeds is not None else params
    processed = getattr(req, "logprobs_mode", "raw_logprobs") == "processed_logprobs"
    stream = await _submit(engine, renderer, per_prompt, endpoint.want_logprobs(req), processed)
    return await _respond(state, request, renderer, stream, req.stream)


def _render(state: ServerState, req: ChatCompletionRequest | MessagesRequest) -> list[int]:
    conversation = req.to_template() if isinstance(req, MessagesRequest) else [m.to_template() for m in req.messages]
    return render_chat(state.tokenizer, conversation, req.template_tools(), state.check_chars)


async def _chat_prompts(state: ServerState, req: ChatCompletionRequest | MessagesRequest) -> list[list[int]]:
    """Messages (and tools) -> template -> ids, all on the prep pool, the text bounded before it is
    tokenised (requests.render_chat)."""
    prompt_ids = await state.off_loop(_render, state, req)
    max_tokens = req.max_tokens if isinstance(req, MessagesRequest) else req.requested_max_tokens()
    state.check_length(len(prompt_ids), max_tokens, "messages")
    return [prompt_ids]


async def _completion_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    given = req.prompt_list()
    for prompt in given:
        if isinstance(prompt, str):
            state.check_chars(len(prompt), "prompt")
    encoded = await state.off_loop(encode_prompts, state.tokenizer, given)
    prompts = []
    for i, ids in enumerate(encoded):
        bad = [t for t in ids if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(400, f"prompt {i} has token id {bad[0]} outside the vocabulary "
                                f"(ids 0..{state.vocab_size - 1})", param="prompt")
        state.check_length(len(ids), req.max_tokens, "prompt")
        prompts.append(ids)
    return prompts


CHAT = Endpoint(ChatCompletionRequest, _chat_prompts, ChatRenderer, lambda req: req.logprobs, constrained=True)
COMPLETIONS = Endpoint(CompletionRequest, _completion_prompts, CompletionRenderer,
                       lambda req: req.logprobs is not None)
MESSAGES = Endpoint(MessagesRequest, _chat_prompts, MessagesRenderer, lambda req: False, constrained=True)
GENERATE = Endpoint(GenerateRequest, generate_prompts, GenerateRenderer,
                    lambda req: req.sampling_params.logprobs is not None, sampling=generate_params)
CHAT_TOKENS = Endpoint(ChatTokensRequest, chat_tokens_prompts, ChatRenderer, lambda req: req.logprobs, constrained=True)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(CHAT, request)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(COMPLETIONS, request)


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    return await _serve(MESSAGES, request)


@router.post(GENERATE_ROUTE)
async def generate(request: Request) -> Response:
    return await _serve(GENERATE, request)


@router.post(CHAT_TOKENS_ROUTE)
async def chat_completions_tokens(request: Request) -> Response:
    return await _serve(CHAT_TOKENS, request)


def _check_admissible(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams) -> None:
    """A request with more sequences than the server ever admits at once can never run: a 400 with
    the request's fix, not the 429 "retry later" of a server that is only busy now."""
    num_seqs = len(prompts) * params.n
    if num_seqs <= engine.capacity:
        return
    longest = max(len(p) for p in prompts) + (params.max_tokens or 0)
    bm = getattr(engine.engine, "block_manager", None)
    kv = f"a KV cache of {bm.num_blocks * bm.block_size} tokens" if bm is not None else "the KV cache"
    raise APIError(400, f"the request needs {num_seqs} sequences ({len(prompts)} prompt(s) x n {params.n}) of "
                        f"up to {longest} tokens, {num_seqs * longest} tokens in all, against {kv}; the server "
                        f"admits at most {engine.capacity} sequences at once (max_num_seqs plus max_waiting "
                        f"{engine.max_waiting}), so it can never run: send at most "
                        f"{max(1, engine.capacity // params.n)} prompts per request, lower n, or raise "
                        "--max_waiting", param="n" if params.n > 1 else "prompt", code="request_too_large")


async def _submit(engine: AsyncEngine, renderer: Renderer, params: SamplingParams | list[SamplingParams],
                  want_logprobs: bool, processed_logprobs: bool = False) -> OutputStream:
    try:
        return await engine.submit(renderer.engine_requests(), params, want_logprobs, processed_logprobs)
    except QueueFullError as exc:
        if engine.metrics is not None:
            engine.metrics.count_queue_full()
        raise APIError(429, f"{exc} (--max_waiting)", type_="rate_limit_exceeded", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except ValueError as exc:  # the engine's own check of an impossible request
        raise APIError(400, str(exc), param=param_named_in(str(exc))) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), type_="service_unavailable") from None


# ------------------------------------------------------------------------------- responses
class EventStream(StreamingResponse):
    """SSE response that runs `on_close` however the response ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _respond(state: ServerState, request: Request, renderer: Renderer, stream: OutputStream,
                   streaming: bool) -> Response:
    engine = state.engine
    assert engine is not None

    def abort_if_unfinished() -> None:
        if not stream.finished:
            engine.abort(stream.request_ids)
            state.metrics.count_disconnect()

    if streaming:
        return EventStream(renderer.sse(stream), abort_if_unfinished)
    collect = asyncio.ensure_future(renderer.collect(stream))
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():
            collect.cancel()
            abort_if_unfinished()
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)  # client closed the request; nobody reads this
    return JSONResponse(collect.result())


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ------------------------------------------------------------------------------- the app
def create_app(config: ServeConfig, loader: Callable[[ServeConfig], tuple[Any, Any]] = load_engine) -> FastAPI:
    """The FastAPI app; `loader(config) -> (engine, tokenizer)` runs in a thread at startup."""
    state = ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(_load(state, loader))
        yield
        loading.cancel()
        if state.engine is not None:
            await state.engine.shutdown()
        state.prep.shutdown(wait=False, cancel_futures=True)

    # the schema is served by a route of ours (`openapi`), behind the key like every route but /health and /metrics
    app = FastAPI(title="astrai", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    app.add_middleware(_AccessLog, metrics=state.metrics)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    app.include_router(tokenizer_routes.router)
    app.include_router(admin.router)
    return app


async def _load(state: ServerState, loader: Callable[[ServeConfig], tuple[Any, Any]]) -> None:
    try:
        engine, tokenizer = await asyncio.to_thread(loader, state.config)
        state.ready(engine, tokenizer)
        logger.info("%s", startup_summary(state, engine))
    except Exception as exc:  # noqa: BLE001 - reported by /health, never crashes the server
        logger.error("loading the model failed: %s", exc)
        state.status, state.error = "failed", str(exc)


# ---- errors: OpenAI's body, Anthropic's on its routes -----------------------------------------
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response(request.url.path in ANTHROPIC_ROUTES)


async def _client_gone(request: Request, exc: ClientGone) -> Response:
    logger.warning("%s %s: %s", request.method, request.url.path, exc)  # one line, no traceback
    return Response(status_code=499)  # nobody reads this


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; routes: {', '.join(ROUTES)}"
    elif exc.status_code == 405:
        message = (f"method {request.method} is not allowed on {request.url.path}; "
                   f"allowed: {headers.get('Allow', 'none')}")
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None,
                    headers=headers or None).response(request.url.path in ANTHROPIC_ROUTES)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                    type_="internal_error").response(request.url.path in ANTHROPIC_ROUTES)


def startup_summary(state: ServerState, engine: Engine) -> str:
    """The line the server logs once the model is loaded: what is served, where, how much fits, the
    step budgets and what the load-time probes chose -- all from `LLMEngine.describe()`."""
    info, cfg = engine.describe(), engine.config  # type: ignore[attr-defined]  # LLMEngine's
    onoff = {True: "on", False: "off"}
    cap = info["long_prefill_token_threshold"]
    text = (f"serving '{state.model_name}' from {state.config.model_dir}: dtype {info['dtype']}, device "
            f"{info['device']}; KV cache {info['kv_cache_tokens']} tokens in "
            f"{info['kv_cache_tokens'] // info['block_size']} blocks of {info['block_size']}; max_model_len "
            f"{info['max_model_len']}; max_num_seqs {info['max_num_seqs']}; prefix caching "
            f"{onoff[cfg.enable_prefix_caching]}, chunked prefill {onoff[cfg.enable_chunked_prefill]}; "
            f"step budget {info['max_num_batched_tokens']} tokens, prefill while decoding "
            f"{'uncapped' if not cap else f'at most {cap} tokens'}; torch threads {info['torch_threads']}")
    probes = info["probes"]
    chosen = []
    if "step_cost" in probes:
        chosen.append(f"chunk {probes['step_cost']['chunk']} from the measured step cost")
    if probes.get("threads", {}).get("probed"):
        chosen.append(f"{probes['threads']['threads']} thread(s)")
    if probes.get("linear_layout", {}).get("probed"):
        chosen.append(f"linear weights {probes['linear_layout']['linear_layout']}")
    if "compile" in probes:
        c = probes["compile"]
        chosen.append(f"compiled decode, {len(c['buckets'])} buckets warmed in {c['warmup_seconds']} s")
    return text + (f"; probed: {', '.join(chosen)}" if chosen else "")


access_logger = logging.getLogger("astrai.serve.access")


class _AccessLog:
    """ASGI middleware: counts responses by route and status, and logs one line per request when
    its response has ended (a stream: its last chunk) -- client, method, path, status, latency.
    uvicorn's own access log is off (cli.py), so each request has exactly this one line."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        start, status = time.perf_counter(), None

        async def counting_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.metrics.count_http(route, status)
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            access_logger.info('%s "%s %s" %s %.1f ms', where, scope["method"], scope["path"],
                               status if status is not None else "-", (time.perf_counter() - start) * 1000)
