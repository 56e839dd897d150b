"""lm-eval's remote tokenizer, as vLLM serves it: `GET /tokenizer_info`, `POST /tokenize` and
`POST /detokenize` at the server's root, with vLLM's request and response shapes, behind the
server's key and error bodies like every route of `app.py`. Long inputs never hold the event loop:
encoding, the tokens' strings and the JSON body run on the prep pool, in pieces that let it in."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from astrai.serve.protocol import DetokenizeRequest, TokenizeRequest
from astrai.serve.requests import APIError
from astrai.serve.state import ServerState

ROUTES = ("/tokenizer_info", "/tokenize", "/detokenize")

router = APIRouter()


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    state.check_auth(request)
    state.check_ready()
    return JSONResponse(_tokenizer_info(state))


def _tokenizer_info(state: ServerState) -> dict[str, Any]:
    """vLLM's: the tokenizer config (JSON values only), its special tokens and their ids, the chat
    template, the class transformers loads it as; model_max_length is the served max_model_len."""
    tok = state.tokenizer
    config = getattr(tok, "config", None) or {}
    info = {k: v for k, v in config.items() if isinstance(v, str | int | float | bool | list | dict | None)
            and k not in ("vocab_file", "merges_file", "tokenizer_file")}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[key] = getattr(tok, key, None)
        info[f"{key}_id"] = getattr(tok, f"{key}_id", None) if info[key] is not None else None
    if getattr(tok, "chat_template", None):
        info["chat_template"] = tok.chat_template
    info["model_max_length"] = state.max_model_len
    info["tokenizer_class"] = config.get("tokenizer_class") or type(tok).__name__
    return info


async def _tokenizer_request(request: Request, model: type) -> tuple[ServerState, Any]:
    """The tokenizer routes' checks: auth, a loaded model, the body, the model name when given."""
    state: ServerState = request.app.state.serve
    state.check_auth(request)
    state.check_ready()
    req = await state.read_request(request, model)
    if req.model is not None:
        state.check_model(req.model)
    return state, req


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    state, req = await _tokenizer_request(request, TokenizeRequest)
    # a megabyte of text is a million ids: encoding them, their strings and the JSON body all run on
    # the prep pool, each in a way that lets the loop in (see _tokenize and json_list)
    return Response(await state.off_loop(_tokenize_body, state, req), media_type="application/json")


def _tokenize_body(state: ServerState, req: TokenizeRequest) -> bytes:
    """The /tokenize response as JSON bytes (vLLM's fields, in its order)."""
    ids, strs = _tokenize(state, req)
    return (f'{{"count":{len(ids)},"max_model_len":{json.dumps(state.max_model_len)},"tokens":{json_list(ids)},'
            f'"token_strs":{"null" if strs is None else json_list(strs)}}}').encode()


def json_list(items: list[Any], chunk: int = 16384) -> str:
    """A JSON array of `items` as JSONResponse writes it, encoded a chunk at a time: the C encoder
    holds the GIL for a whole call (0.1 s for a million token strings), and between chunks the
    event loop's thread gets its turn."""
    parts = (json.dumps(items[i : i + chunk], ensure_ascii=False, separators=(",", ":"))[1:-1]
             for i in range(0, len(items), chunk))
    return "[" + ",".join(parts) + "]"


def _tokenize(state: ServerState, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
    """vLLM's defaults: special tokens added to a prompt, not to a rendered chat (it has them).
    Encoded through `encode_batch`, which releases the GIL while the tokenizer works (a single
    `encode` holds it: a second for a megabyte, with the event loop's thread waiting)."""
    tok, text = state.tokenizer, req.prompt
    if req.messages is not None:
        try:
            text = tok.apply_chat_template([m.to_template() for m in req.messages], tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt, tools=req.template_tools())
        except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the client's
            raise APIError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None
    add_special = req.add_special_tokens if req.add_special_tokens is not None else req.messages is None
    ids = tok.encode_batch([text], add_special_tokens=add_special)[0]
    return ids, [state.token_text(i) for i in ids] if req.return_token_strs else None


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    state, req = await _tokenizer_request(request, DetokenizeRequest)
    vocab = len(state.tokenizer)
    for i, token in enumerate(req.tokens):
        if not 0 <= token < vocab:
            raise APIError(400, f"tokens[{i}] is {token}, outside the vocabulary (ids 0..{vocab - 1}); send "
                                "ids this model's tokenizer knows", param="tokens")
    return JSONResponse({"prompt": await state.off_loop(state.decode, req.tokens)})
