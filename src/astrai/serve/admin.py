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

The broadcast transport needs no shared filesystem: `POST /v1/weight_group` makes the server a member
of a `torch.distributed` gloo group with the trainer's rank 0 (rank 0 of the group; the servers
1..N), after checking that the trainer's tensor names and shapes are the served model's; then each
`POST /v1/load_weights {"policy_version": N, "transport": "broadcast"}` receives the weights tensor by
tensor (in name order) from rank 0 on the engine thread, between steps, as the filesystem load does.
Every collective has the group's timeout.
"""

from __future__ import annotations

import asyncio
import datetime
import hmac
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, model_validator

from astrai.serve.protocol import StrictModel
from astrai.serve.requests import APIError, parse_request, read_body
from astrai.serve.state import ServerState

ADMIN_ROUTES = ("/v1/load_weights", "/v1/weight_group")
router = APIRouter()


class LoadWeightsRequest(StrictModel):
    path: str | None = None  # filesystem: a model directory with a manifest, under --weights_dir
    policy_version: int = Field(ge=0)  # what responses report from now on (may go back: a resumed trainer)
    transport: str = Field("filesystem", pattern="^(filesystem|broadcast)$")

    @model_validator(mode="after")
    def _path_for_filesystem(self) -> LoadWeightsRequest:
        if self.transport == "filesystem" and not self.path:
            raise ValueError("the filesystem transport needs 'path' (a published model directory)")
        return self


class WeightGroupRequest(StrictModel):
    master_addr: str
    master_port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1)  # 0 is the trainer's
    world_size: int = Field(ge=2)
    timeout_s: float = Field(600.0, gt=0)  # of every collective in the group
    tensors: dict[str, list[int]]  # the trainer's names and shapes; it sends them in name order


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


def read_weights(state: ServerState, path: Path, like: Any) -> dict[str, Any]:
    """A published model directory's weights, manifest verified, in the served model's dtype and
    on its device (runs on a worker thread); a LoRA adapter directory is merged onto its base, which
    must be the served model's directory or lie under --weights_dir. ValueError / OSError naming the
    file when damaged."""
    from astrai.model.hf import load_model
    from astrai.model.lora import is_adapter_dir, resolve_base
    from astrai.model.manifest import MANIFEST

    if not (path / MANIFEST).is_file():
        raise ValueError(f"'{path}' has no {MANIFEST}; load only directories published with one "
                         "(astrai's atomic publish), so a half-written directory is never served")
    first = next(like.parameters())
    if is_adapter_dir(path) and not (path / "config.json").is_file():
        base = resolve_base(path).resolve()
        served = Path(state.config.model_dir).resolve()
        if base != served and not base.is_relative_to(Path(state.config.weights_dir or served).resolve()):
            raise ValueError(f"the adapter's base model {base} is neither the served model ({served}) nor under "
                             "--weights_dir; publish adapters of the served base")
        return load_model(base, dtype=first.dtype, device=first.device, verify=True, lora=path).state_dict()
    return load_model(path, dtype=first.dtype, device=first.device, verify=True).state_dict()


async def _admin_request(request: Request, model: type) -> tuple[ServerState, Any, Any]:
    state: ServerState = request.app.state.serve
    check_admin(state, request)
    engine = state.check_ready()
    body = await read_body(request, state.config.max_request_bytes, state.config.body_timeout)
    return state, engine, parse_request(body, model)


@router.post("/v1/weight_group")
async def weight_group(request: Request) -> Response:
    """Join the trainer's gloo group (blocks until every member joined, within timeout_s)."""
    state, engine, req = await _admin_request(request, WeightGroupRequest)
    own = engine.engine.model.state_dict()  # type: ignore[attr-defined]  # LLMEngine's
    theirs = {name: tuple(shape) for name, shape in req.tensors.items()}
    mine = {name: tuple(t.shape) for name, t in own.items()}
    if theirs != mine:
        wrong = sorted(set(theirs) ^ set(mine)) or sorted(n for n in mine if theirs[n] != mine[n])
        raise APIError(400, f"the trainer's weights do not fit the served model (first differing tensor: "
                            f"{wrong[0]}); serve a model of the trainer's architecture", param="tensors")
    try:
        state.weight_group = await asyncio.to_thread(join_group, req)
    except Exception as exc:  # noqa: BLE001 - a rendezvous that failed or timed out: the client's to fix
        raise APIError(400, f"joining the weight group at {req.master_addr}:{req.master_port} as rank {req.rank} "
                            f"failed: {exc}", code="weight_group_failed") from None
    state.weight_names = sorted(req.tensors)
    return JSONResponse({"rank": req.rank, "world_size": req.world_size})


def join_group(req: WeightGroupRequest) -> Any:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=req.timeout_s)
    store = dist.TCPStore(req.master_addr, req.master_port, req.world_size, False, timeout=timeout)
    return dist.ProcessGroupGloo(store, req.rank, req.world_size, timeout)


def broadcast_receiver(group: Any, names: list[str], engine: Any, version: int) -> Callable[[], None]:
    """On the engine thread: every tensor from rank 0 in `names` order, then loaded as `version`."""
    import torch
    import torch.distributed as dist

    def receive() -> None:
        own = engine.model.state_dict()
        received = {}
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for name in names:
            buf = torch.empty(own[name].shape, dtype=own[name].dtype, device="cpu")  # gloo: contiguous, on the host
            group.broadcast([buf], opts).wait()
            received[name] = buf
        engine.load_weights(received, version)

    return receive


@router.post("/v1/load_weights")
async def load_weights(request: Request) -> Response:
    state, engine, req = await _admin_request(request, LoadWeightsRequest)
    if req.transport == "broadcast":
        if state.weight_group is None:
            raise APIError(409, "no weight group: POST /v1/weight_group first (the trainer does it at start)",
                           code="no_weight_group")
        start = time.perf_counter()
        try:
            await engine.run_between_steps(broadcast_receiver(state.weight_group, state.weight_names, engine.engine,
                                                              req.policy_version))
        except Exception as exc:  # noqa: BLE001 - a collective that failed or timed out
            raise APIError(500, f"receiving policy version {req.policy_version} (broadcast transport) failed: "
                                f"{exc}", type_="internal_error") from None
        return JSONResponse({"policy_version": req.policy_version, "transport": "broadcast",
                             "seconds": round(time.perf_counter() - start, 4)})
    path = allowed_dir(state, req.path)
    start = time.perf_counter()
    model = engine.engine.model  # type: ignore[attr-defined]  # LLMEngine's
    try:
        weights = await asyncio.to_thread(read_weights, state, path, model)
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
