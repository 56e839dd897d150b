"""`astrai serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

Data flow: HTTP body -> size limit -> JSON -> pydantic request (`protocol.py`) -> prompt token ids
(chat template or plain text; those steps are in `requests.py`) -> `SamplingParams` ->
`AsyncEngine.submit` (engine thread) -> `RequestUpdate`s -> OpenAI JSON or SSE chunks. Everything
a client can get wrong is answered with OpenAI's error body before the request reaches the
engine, so a bad request never touches the requests already running. The model loads in the
background after the socket is bound: `/health` answers 503 until it is ready. The command line
(flags, uvicorn, graceful SIGTERM) is `cli.py`.

No one request may stall the others: the body must arrive within `--body_timeout` (408);
JSON parsing, template rendering and tokenisation run on a small thread pool, after a
character-count check that refuses a prompt too long to fit before encoding it; admission is
bounded by max_num_seqs plus `--max_waiting` (429 with Retry-After beyond it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from astrai.infer.defaults import describe, generation_defaults
from astrai.serve.anthropic import MessagesRenderer, MessagesRequest
from astrai.serve.async_engine import AsyncEngine, EngineDeadError, OutputStream, QueueFullError
from astrai.serve.metrics import ServerMetrics
from astrai.serve.protocol import ChatCompletionRequest, CompletionRequest, ignored_fields
from astrai.serve.render import ChatRenderer, CompletionRenderer, Renderer
from astrai.serve.requests import (
    APIError,
    ClientGone,
    encode_prompts,
    param_named_in,
    parse_request,
    read_body,
    render_chat,
    render_messages,
)

logger = logging.getLogger("astrai.serve")
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/models", "/health", "/metrics")
ANTHROPIC_ROUTES = ("/v1/messages",)  # errors there use Anthropic's body
RETRY_AFTER_S = 1  # what a 429 tells the client to wait
MAX_IGNORED_LOGGED = 256  # distinct ignored field names logged; a client inventing names cannot flood the log
PREP_THREADS = 4  # JSON parsing, chat templates and tokenisation run here, never on the event loop


@dataclass
class ServeConfig:
    model_dir: str
    served_model_name: str | None = None  # default: the model directory's basename
    api_key: str | None = None
    max_request_bytes: int = 8 * 2**20
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    max_waiting: int | None = None  # sequences admitted beyond max_num_seqs; None = 4 x max_num_seqs
    body_timeout: float = 30.0  # seconds the whole request body may take to arrive
    verify: bool = False  # recompute a checkpoint manifest's sha256 checksums before loading
    generation_config: str = "auto"  # unset sampling fields: the model's defaults (auto), none, or a dir

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name


def load_engine(config: ServeConfig) -> tuple[Any, Any]:
    """Build the engine (and its tokenizer) from the model directory; runs off the event loop."""
    from astrai.data.tokenizer import load_tokenizer
    from astrai.infer.engine import LLMEngine
    from astrai.model.manifest import check_model_dir

    check_model_dir(config.model_dir, verify=config.verify)
    engine = LLMEngine.from_pretrained(config.model_dir, **config.engine_kwargs)
    tokenizer = getattr(engine, "tokenizer", None) or load_tokenizer(config.model_dir)
    return engine, tokenizer


class ServerState:
    """What the routes share: the engine loop, the tokenizer, limits and metrics."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.model_name = config.model_name
        self.metrics = ServerMetrics(self.model_name)
        self.status, self.error = "loading", ""
        self.engine: AsyncEngine | None = None
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self.max_prompt_chars = 0  # more characters than this cannot fit in max_model_len tokens
        self.prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="astrai-prep")
        self._guides: Any = None  # GuideCompiler, built on the first constrained request
        self._guides_lock = threading.Lock()
        self._ignored_logged: set[str] = set()
        # the model's sampling defaults, for the fields a request leaves unset (vLLM's behaviour)
        self.generation_defaults = generation_defaults(config.model_dir, config.generation_config)

    def ready(self, engine: Any, tokenizer: Any) -> None:
        if self.generation_defaults:
            logger.info("%s", describe(self.generation_defaults))
        self.tokenizer = tokenizer
        self.max_model_len = int(engine.max_model_len)
        model_config = getattr(getattr(engine, "model", None), "config", None)
        self.vocab_size = int(getattr(model_config, "vocab_size", 0) or tokenizer.vocab_size)
        self.max_prompt_chars = self.max_model_len * _max_token_chars(tokenizer)
        self.engine = AsyncEngine(engine, self.metrics, self.config.max_waiting)
        self.engine.start()
        self.status = "ready"

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run CPU work of one request on the prep pool, so the loop keeps answering the others."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before encoding, a prompt with more characters than max_model_len tokens can hold."""
        if self.max_prompt_chars and num_chars > self.max_prompt_chars:
            raise APIError(400, f"prompt has {num_chars} characters, more than max_model_len "
                                f"{self.max_model_len} tokens can hold (at most {self.max_prompt_chars}); "
                                f"shorten the {param}", param=param)

    def note_ignored(self, route: str, names: list[str]) -> None:
        """Count a request that carried fields astrai ignores; log each field name the first time."""
        if not names:
            return
        self.metrics.count_ignored_fields(route)
        for name in names:
            if name not in self._ignored_logged and len(self._ignored_logged) < MAX_IGNORED_LOGGED:
                self._ignored_logged.add(name)
                logger.warning("%s: ignoring the unsupported request field '%s' (logged once)", route, name)

    def chat_guide(self, req: ChatCompletionRequest) -> Any:
        """The grammar a chat request's output must follow (on the prep pool), or None."""
        from astrai.infer.guided import GuideCompiler, GuideError

        fmt, choice = req.response_format, req.effective_tool_choice()
        constrained = (fmt is not None and fmt.type != "text") or choice == "required" or not isinstance(choice, str)
        if not constrained:
            return None
        param = "response_format" if fmt is not None and fmt.type != "text" else "tool_choice"
        try:
            with self._guides_lock:
                if self._guides is None:
                    self._guides = GuideCompiler(self.tokenizer, self.vocab_size)
            if param == "response_format":
                if fmt.type == "json_object":
                    return self._guides.json_object()
                return self._guides.json_schema(fmt.json_schema.schema_)
            tools = [(t.function.name, t.function.parameters) for t in req.tools or []]
            if not isinstance(choice, str):  # a named function
                tools = [t for t in tools if t[0] == choice.function.name]
            return self._guides.tool_calls(tools, req.parallel_tool_calls)
        except GuideError as exc:
            raise APIError(400, str(exc), param=param if param == "response_format" else "tools") from None

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    # ---- checks every /v1 request goes through -------------------------------------------
    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise APIError(401, "missing or incorrect API key; send the header 'Authorization: Bearer <key>' "
                                "or 'x-api-key: <key>'", code="invalid_api_key")

    def check_ready(self) -> AsyncEngine:
        if self.status != "ready" or self.engine is None:
            detail = f": {self.error}" if self.error else "; retry when GET /health answers 200"
            raise APIError(503, f"the model is {self.status}{detail}", type_="service_unavailable")
        return self.engine

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(400, f"prompt has {num_prompt_tokens} tokens but max_model_len is {limit}; "
                                f"shorten the {param} to fewer than {limit} tokens", param=param)
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(400, f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}, "
                                f"{num_prompt_tokens + max_tokens} in all, but max_model_len is {limit}; "
                                f"lower max_tokens to at most {limit - num_prompt_tokens}",
                           param="max_tokens")

    def sampling_params(self, req: ChatCompletionRequest | CompletionRequest | MessagesRequest,
                        max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        guide: Any = None) -> Any:
        from astrai.infer.sampling import SamplingParams

        kwargs: dict[str, Any] = dict(
            max_tokens=max_tokens, n=req.n, stop=req.stop_list() or None, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, guide=guide)
        kwargs.update(self.generation_defaults)  # the model's own, where the request is silent
        for name in ("seed", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "temperature", "top_p",
                     "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            if getattr(req, name, None) is not None:  # the Messages API has only some of these
                kwargs[name] = getattr(req, name)
        try:
            params = SamplingParams(**kwargs)
            params.check_vocab(self.vocab_size)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param_named_in(str(exc))) from None
        return params


def _max_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary entry in characters: no token covers more of the input than this."""
    backend = getattr(tokenizer, "backend", tokenizer)
    try:
        return max(16, max(len(t) for t in backend.get_vocab(with_added_tokens=True)))
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: a generous fixed bound
        return 256


async def read_request(request: Request, model: type, state: ServerState) -> Any:
    """Body (on the loop, bounded in time and size) -> JSON -> pydantic (on the prep pool)."""
    body = await read_body(request, state.config.max_request_bytes, state.config.body_timeout)
    req = await state.off_loop(parse_request, body, model)
    state.note_ignored(request.url.path, ignored_fields(req))
    return req


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

    async def load() -> None:
        try:
            engine, tokenizer = await asyncio.to_thread(loader, config)
            state.ready(engine, tokenizer)
            logger.info("%s", startup_summary(state, engine))
        except Exception as exc:  # noqa: BLE001 - reported by /health, never crashes the server
            logger.error("loading the model failed: %s", exc)
            state.status, state.error = "failed", str(exc)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(load())
        yield
        loading.cancel()
        if state.engine is not None:
            await state.engine.shutdown()
        state.prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="astrai", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serve = state
    app.add_middleware(_AccessLog, metrics=state.metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path in ANTHROPIC_ROUTES)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        logger.warning("%s %s: %s", request.method, request.url.path, exc)  # one line, no traceback
        return Response(status_code=499)  # nobody reads this

    @app.exception_handler(StarletteHTTPException)
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

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                        type_="internal_error").response(request.url.path in ANTHROPIC_ROUTES)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if state.status == "ready":
            return JSONResponse({"status": "ok"})
        return APIError(503, f"the model is {state.status}" + (f": {state.error}" if state.error else ""),
                        type_="service_unavailable").response()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = state.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        state.check_auth(request)
        state.check_ready()
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "astrai",
                "max_model_len": state.max_model_len or None}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        state.check_auth(request)
        engine = state.check_ready()
        req = await read_request(request, ChatCompletionRequest, state)
        state.check_model(req.model)
        num_chars = sum(len(m.to_template()["content"] or "") for m in req.messages)
        state.check_chars(num_chars + sum(len(t.model_dump_json()) for t in req.tools or []), "messages")
        prompt_ids = await state.off_loop(render_chat, state.tokenizer, req)
        max_tokens = req.requested_max_tokens()
        state.check_length(len(prompt_ids), max_tokens, "messages")
        guide = await state.off_loop(state.chat_guide, req)
        params = state.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                       guide=guide)
        renderer = ChatRenderer(state, req, [prompt_ids])
        stream = await _submit(engine, renderer, params, req.logprobs)
        return await _respond(state, request, renderer, stream, req.stream)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        state.check_auth(request)
        engine = state.check_ready()
        req = await read_request(request, CompletionRequest, state)
        state.check_model(req.model)
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
        # echo with logprobs: the prompt's tokens get log-probs too (computed by the engine)
        params = state.sampling_params(req, req.max_tokens, req.logprobs,
                                       req.logprobs if req.echo and req.logprobs is not None else None)
        renderer = CompletionRenderer(state, req, prompts)
        stream = await _submit(engine, renderer, params, req.logprobs is not None)
        return await _respond(state, request, renderer, stream, req.stream)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        state.check_auth(request)
        engine = state.check_ready()
        req = await read_request(request, MessagesRequest, state)
        state.check_model(req.model)
        conversation = req.to_template()
        state.check_chars(sum(len(m["content"]) for m in conversation), "messages")
        prompt_ids = await state.off_loop(render_messages, state.tokenizer, conversation)
        state.check_length(len(prompt_ids), req.max_tokens, "messages")
        params = state.sampling_params(req, req.max_tokens, None)
        renderer = MessagesRenderer(state, req, [prompt_ids])
        stream = await _submit(engine, renderer, params, False)
        return await _respond(state, request, renderer, stream, req.stream)

    return app


async def _submit(engine: AsyncEngine, renderer: Renderer, params: Any, want_logprobs: bool) -> OutputStream:
    try:
        return await engine.submit(renderer.engine_requests(), params, want_logprobs)
    except QueueFullError as exc:
        if engine.metrics is not None:
            engine.metrics.count_queue_full()
        raise APIError(429, f"{exc} (--max_waiting)", type_="rate_limit_exceeded", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except ValueError as exc:  # the engine's own check of an impossible request
        raise APIError(400, str(exc), param=param_named_in(str(exc))) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), type_="service_unavailable") from None


def startup_summary(state: ServerState, engine: Any) -> str:
    """The line the server logs once the model is loaded: what is served, where, how much fits, the
    step budgets and what the load-time probes chose -- all from `LLMEngine.describe()`."""
    info, cfg = engine.describe(), engine.config
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
