"""What the server's routes share: its configuration, the loaded engine and the per-request checks.

`app.py` builds one `ServerState` per app (`create_app`) and stores it as `app.state.serve`; the
routes read it for every request. It holds the async engine loop (`async_engine.py`) once the
model has loaded, the tokenizer, the limits derived from them (max_model_len, the longest prompt
in characters), the prep pool on which parsing, templates and tokenisation run, the lazily built
grammar compiler, the model's generation_config.json sampling defaults and the metrics. Its
`check_*` methods raise the `APIError`s every /v1 request can meet before it reaches the engine;
turning a request into `SamplingParams` and a grammar guide is `requests.py`'s.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request

from astrai.infer.defaults import describe, generation_defaults
from astrai.infer.guided import GuideCompiler, GuideError, check_guide_budget
from astrai.infer.sampling import SamplingParams
from astrai.serve.async_engine import AsyncEngine, Engine
from astrai.serve.metrics import ServerMetrics
from astrai.serve.protocol import ignored_fields
from astrai.serve.requests import APIError, SamplingRequest, parse_request, read_body, to_sampling_params

logger = logging.getLogger("astrai.serve")
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
    verify: bool | None = None  # recompute manifest sha256s before loading; None: when small (check_model_dir)
    generation_config: str = "auto"  # unset sampling fields: the model's defaults (auto), none, or a dir
    max_guide_bytes: int = 4 * 2**20  # grammar bytes x n a constrained request may carry (infer/guided.py)
    admin_key: str | None = None  # the admin routes (serve/admin.py) are on only with a key
    weights_dir: str | None = None  # /v1/load_weights loads only directories under this one

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name


def load_engine(config: ServeConfig) -> tuple[Any, Any]:
    """Build the engine (and its tokenizer) from the model directory; runs off the event loop."""
    from astrai.data.tokenizer import load_tokenizer
    from astrai.infer.engine import LLMEngine
    from astrai.model.manifest import check_model_dir

    check_model_dir(config.model_dir, verify=config.verify)
    if config.engine_kwargs.get("lora"):
        check_model_dir(config.engine_kwargs["lora"], verify=config.verify)
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
        self._guides: GuideCompiler | None = None  # built on the first constrained request
        self._guides_lock = threading.Lock()
        self._ignored_logged: set[str] = set()
        self.loaded_path: str | None = None  # the weights the last /v1/load_weights put in place
        self.weight_group: Any = None  # the broadcast transport's group (serve/admin.WeightGroup), once joined
        # the model's sampling defaults, for the fields a request leaves unset (vLLM's behaviour)
        self.generation_defaults = generation_defaults(config.model_dir, config.generation_config)

    def ready(self, engine: Engine, tokenizer: Any) -> None:
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

    async def read_request(self, request: Request, model: type, max_messages: int | None = None) -> Any:
        """Body (on the loop, bounded in time and size) -> JSON -> pydantic `model` -> the names of its
        ignored fields (on the prep pool: each grows with the body), noted for the route."""
        body = await read_body(request, self.config.max_request_bytes, self.config.body_timeout)
        req, ignored = await self.off_loop(_parse, body, model, max_messages)
        self.note_ignored(request.url.path, ignored)
        return req

    def note_ignored(self, route: str, names: list[str]) -> None:
        """Count a request that carried fields astrai ignores; log each field name the first time."""
        if not names:
            return
        self.metrics.count_ignored_fields(route)
        for name in names:
            if name not in self._ignored_logged and len(self._ignored_logged) < MAX_IGNORED_LOGGED:
                self._ignored_logged.add(name)
                logger.warning("%s: ignoring the unsupported request field '%s' (logged once)", route, name)

    def guide_compiler(self) -> GuideCompiler:
        """The grammar compiler for constrained requests, built once on first use (on the prep pool)."""
        with self._guides_lock:
            if self._guides is None:
                self._guides = GuideCompiler(self.tokenizer, self.vocab_size, self.config.max_guide_bytes)
            return self._guides

    def sampling_params(self, req: SamplingRequest, **renamed: Any) -> SamplingParams:
        """The request's SamplingParams (requests.py), over the model's defaults; 400 when invalid,
        or when its grammar times n is more than max_guide_bytes."""
        params = to_sampling_params(req, self.generation_defaults, self.vocab_size, **renamed)
        if params.guide is not None:
            try:
                check_guide_budget(params.guide, params.n, self.config.max_guide_bytes)
            except GuideError as exc:
                raise APIError(400, str(exc), param="n") from None
        return params

    # ---- what the renderers read (render.RenderContext) ---------------------------------------
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

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

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before encoding, a prompt with more characters than max_model_len tokens can hold."""
        if self.max_prompt_chars and num_chars > self.max_prompt_chars:
            raise APIError(400, f"prompt has {num_chars} characters, more than max_model_len "
                                f"{self.max_model_len} tokens can hold (at most {self.max_prompt_chars}); "
                                f"shorten the {param}", param=param)

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


def _max_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary entry in characters: no token covers more of the input than this."""
    backend = getattr(tokenizer, "backend", tokenizer)
    try:
        return max(16, max(len(t) for t in backend.get_vocab(with_added_tokens=True)))
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: a generous fixed bound
        return 256


def _parse(body: bytes, model: type, max_messages: int | None) -> tuple[Any, list[str]]:
    req = parse_request(body, model, max_messages)
    return req, ignored_fields(req)
