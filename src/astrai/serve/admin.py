"""The server's admin routes: weight updates into a running `astrai serve` (`POST /v1/load_weights`).

A trainer drawing rollouts from this server (``train/rl/http_sampler.py``) publishes each new
policy version as a model directory (the atomic publish with its manifest) and asks every
server to load it: `{"path": DIR, "policy_version": N}`. The route is off unless the server was
started with `--admin_key KEY` (sent as `Authorization: Bearer KEY`, distinct from `--api_key`), and
loads only directories under `--weights_dir`. The manifest is verified (sizes and sha256) and the
weights read off the event loop; they are applied on the engine thread between steps
(``AsyncEngine.run_between_steps``): the requests in flight finish on the weights they started
with, new ones wait and then run on the new weights, and every response names its
`policy_version`. A refused load is a 4xx naming why; the server keeps serving the old weights.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from astrai.serve.protocol import StrictModel
from astrai.serve.requests import APIError, parse_request, read_body
from astrai.serve.state import ServerState

ADMIN_ROUTES = ("/v1/load_weights",)
router = APIRouter()


class LoadWeightsRequest(StrictModel):
    path: str  # a model directory with a manifest, under --weights_dir
    policy_version: int = Field(ge=0)  # what responses report from now on (may go back: a resumed trainer)


def check_admin(state: ServerState, request: Request) -> None:
    """403 when the admin routes are off, 401 when the key is missing or wrong."""
    key = state.config.admin_key
    if not key:
        raise APIError(403, "the admin routes are off on this server; start it with --admin_key KEY (and "
                            "--weights_dir DIR) to load weights into it", code="admin_disabled")
    given = request.headers.get("authorization", "")
    token = given[7:] if given[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(token.encode(), key.encode()):
        raise APIError(401, "missing or incorrect admin key; send 'Authorization: Bearer <admin key>' (the "
                            "server's --admin_key, not its --api_key)", code="invalid_admin_key")


def allowed_dir(state: ServerState, path: str) -> Path:
    """The directory to load, resolved (links followed); 403 unless it lies under --weights_dir."""
    root = state.config.weights_dir
    if not root:
        raise APIError(403, "this server loads no weights: it was started without --weights_dir DIR",
                       param="path", code="path_not_allowed")
    resolved, allowed = Path(path).resolve(), Path(root).resolve()
    if not resolved.is_relative_to(allowed):
        raise APIError(403, f"path '{path}' is outside the directory this server loads weights from "
                            f"({allowed}, --weights_dir); publish the weights there", param="path",
                       code="path_not_allowed")
    return resolved


def read_weights(path: Path, like: Any) -> dict[str, Any]:
    """A published model directory's weights, manifest verified, in the served model's dtype and
    on its device (runs on a worker thread). ValueError / OSError naming the file when damaged."""
    from astrai.model.hf import load_model
    from astrai.model.manifest import MANIFEST

    if not (path / MANIFEST).is_file():
        raise ValueError(f"'{path}' has no {MANIFEST}; load only directories published with one "
                         "(astrai's atomic publish), so a half-written directory is never served")
    first = next(like.parameters())
    return load_model(path, dtype=first.dtype, device=first.device, verify=True).state_dict()


@router.post("/v1/load_weights")
async def load_weights(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    check_admin(state, request)
    engine = state.check_ready()
    body = await read_body(request, state.config.max_request_bytes, state.config.body_timeout)
    req = parse_request(body, LoadWeightsRequest)
    path = allowed_dir(state, req.path)
    start = time.perf_counter()
    model = engine.engine.model  # type: ignore[attr-defined]  # LLMEngine's
    try:
        weights = await asyncio.to_thread(read_weights, path, model)
    except (ValueError, OSError) as exc:
        raise APIError(400, f"cannot load weights from '{req.path}': {exc}", param="path") from None
    read_s = time.perf_counter() - start
    try:
        await engine.run_between_steps(lambda: engine.engine.load_weights(weights, req.policy_version))
    except ValueError as exc:
        raise APIError(400, f"cannot load weights from '{req.path}': {exc}", param="path") from None
    state.loaded_path = str(path)
    return JSONResponse({"policy_version": req.policy_version, "path": str(path), "read_seconds": round(read_s, 4),
                         "seconds": round(time.perf_counter() - start, 4)})
