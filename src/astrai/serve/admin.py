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

The broadcast transport needs no shared filesystem: `GET /v1/weight_group` tells a trainer where the
served weights live and which backends this server can join (`model/weight_broadcast.py`: NCCL when
they are on CUDA); `POST /v1/weight_group` makes the server a member of a `torch.distributed` group
(gloo or NCCL) with the trainer's rank 0 (rank 0 of the group; the servers 1..N), after checking that
the trainer's tensor names and shapes fit the served model: its whole state dict, or a LoRA run's
adapter tensors (`adapter`: the base, which must be the served model's directory or lie under
--weights_dir, is read once and kept on the host). Then each `POST /v1/load_weights
{"policy_version": N, "transport": "broadcast"}` receives the tensors one by one (in name order) from
rank 0 on the engine thread, between steps, as the filesystem load does: into the served model's
device memory with NCCL, through host memory with gloo; an adapter is merged onto the kept base first
(`lora.merged_weight`, the trainer's arithmetic). Every rendezvous and collective is bounded by the
group's timeout; one that fails drops the group (the trainer opens a new one) and answers 500 in one
line naming the transport and the backend.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

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


class AdapterSpec(StrictModel):
    """A LoRA run's adapter: the tensors are `<layer>.lora_A` / `.lora_B`, merged onto `base_model`."""

    base_model: str  # the trainer's base directory: the served model's, or one under --weights_dir
    scaling: float  # lora_alpha / r


class WeightGroupRequest(StrictModel):
    master_addr: str
    master_port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1)  # 0 is the trainer's
    world_size: int = Field(ge=2)
    timeout_s: float = Field(600.0, gt=0)  # of the rendezvous and every collective in the group
    tensors: dict[str, list[int]]  # the trainer's names and shapes; it sends them in name order
    backend: Literal["gloo", "nccl"] = "gloo"
    dtype: str | None = None  # the tensors' dtype on the wire (default: each served tensor's own)
    adapter: AdapterSpec | None = None  # only a LoRA adapter travels (tensors: its lora_A / lora_B)


@dataclass
class WeightGroup:
    """A joined weight group and what each broadcast load receives through it."""

    group: Any
    backend: str
    timeout_s: float
    tensors: dict[str, tuple[Any, tuple[int, ...]]]  # name -> (torch dtype, shape), in the order rank 0 sends
    scaling: float = 0.0  # an adapter's; 0 when whole weights travel
    base: dict[str, Any] = field(default_factory=dict)  # an adapter's base weights (host tensors)


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


@router.get("/v1/weight_group")
async def weight_group_info(request: Request) -> Response:
    """What a trainer needs before it opens a group: the served weights' device and the backends this
    server can join, and where it reads a LoRA adapter's base from (its model, or under --weights_dir)."""
    from astrai.model.weight_broadcast import backends_here, gpu_id

    state: ServerState = request.app.state.serve
    check_admin(state, request)
    engine = state.check_ready()
    device = next(engine.engine.model.parameters()).device  # type: ignore[attr-defined]  # LLMEngine's
    joined = state.weight_group
    return JSONResponse({"device": str(device), "gpu": gpu_id(device), "backends": backends_here(device),
                         "model_dir": str(Path(state.config.model_dir).resolve()),
                         "weights_dir": str(Path(state.config.weights_dir).resolve()) if state.config.weights_dir else None,
                         "backend": joined.backend if joined is not None else None})


@router.post("/v1/weight_group")
async def weight_group(request: Request) -> Response:
    """Join the trainer's group (blocks until every member joined, within timeout_s)."""
    from astrai.model import weight_broadcast

    state, engine, req = await _admin_request(request, WeightGroupRequest)
    model = engine.engine.model  # type: ignore[attr-defined]  # LLMEngine's
    device = next(model.parameters()).device
    if req.backend not in weight_broadcast.backends_here(device):
        raise APIError(400, f"this server cannot join an {req.backend} weight group: its weights are on {device} "
                            f"(backends here: {', '.join(weight_broadcast.backends_here(device))})", param="backend")
    try:
        wire = weight_broadcast.wire_dtype(req.dtype) if req.dtype else None
    except ValueError as exc:
        raise APIError(400, str(exc), param="dtype") from None
    own = model.state_dict()
    expected = adapter_shapes(req.tensors, own) if req.adapter else {n: tuple(t.shape) for n, t in own.items()}
    theirs = {name: tuple(shape) for name, shape in req.tensors.items()}
    if theirs != expected:
        wrong = sorted(set(theirs) ^ set(expected)) or sorted(n for n in expected if theirs[n] != expected[n])
        raise APIError(400, f"the trainer's weights do not fit the served model (first differing tensor: "
                            f"{wrong[0]}); serve a model of the trainer's architecture", param="tensors")
    base: dict[str, Any] = {}
    if req.adapter:
        try:
            base = await asyncio.to_thread(adapter_base, state, req.adapter.base_model, req.tensors, model)
        except (ValueError, OSError) as exc:
            raise APIError(400, f"cannot apply the trainer's adapter: {exc}", param="adapter.base_model") from None
    if state.weight_group is not None:  # a restarted trainer: the old group is gone with it
        weight_broadcast.abort(state.weight_group.group)
        state.weight_group = None
    try:
        group = await asyncio.to_thread(weight_broadcast.open_group, req.backend, req.master_addr, req.master_port,
                                        req.rank, req.world_size, req.timeout_s)
    except weight_broadcast.WeightBroadcastError as exc:  # a rendezvous that failed or timed out
        raise APIError(400, str(exc), code="weight_group_failed") from None
    tensors = {name: (wire or own.get(name, own.get(_weight_of(name))).dtype, tuple(req.tensors[name]))
               for name in sorted(req.tensors)}
    state.weight_group = WeightGroup(group, req.backend, req.timeout_s, tensors,
                                     req.adapter.scaling if req.adapter else 0.0, base)
    return JSONResponse({"rank": req.rank, "world_size": req.world_size, "backend": req.backend})


def _weight_of(adapter_name: str) -> str:
    """`<layer>.lora_A` / `<layer>.lora_B` -> `<layer>.weight`, the base weight the pair changes."""
    return adapter_name.rsplit(".", 1)[0] + ".weight"


def adapter_shapes(tensors: dict[str, list[int]], own: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shapes a LoRA adapter over the served model has for the layers whose `lora_A` `tensors`
    names (r read from it): lora_A (r, in) and lora_B (out, r) for a base weight (out, in). A name that
    is no adapter tensor of this model is left out, so the comparison with `tensors` names it."""
    shapes = {}
    for name, shape in tensors.items():
        weight = own.get(_weight_of(name))
        if name.endswith(".lora_A") and weight is not None and weight.dim() == 2 and len(shape) == 2:
            layer, r = name.removesuffix("lora_A"), shape[0]
            shapes[layer + "lora_A"], shapes[layer + "lora_B"] = (r, weight.shape[1]), (weight.shape[0], r)
    return shapes


def adapter_base(state: ServerState, base_model: str, tensors: dict[str, list[int]], like: Any) -> dict[str, Any]:
    """The base weights an adapter's layers change, read once from `base_model` (the served model's
    directory or one under --weights_dir; manifest checked), in the served dtype, on the host."""
    from astrai.model.hf import load_model

    base = Path(base_model).resolve()
    served = Path(state.config.model_dir).resolve()
    if base != served and not (state.config.weights_dir and base.is_relative_to(Path(state.config.weights_dir).resolve())):
        raise ValueError(f"its base model {base} is neither the served model ({served}) nor under --weights_dir; "
                         "serve the run's param_path")
    state_dict = load_model(base, dtype=next(like.parameters()).dtype, device="cpu").state_dict()
    return {_weight_of(name): state_dict[_weight_of(name)] for name in tensors}


def broadcast_receiver(joined: WeightGroup, engine: Any, version: int) -> Callable[[], int]:
    """On the engine thread: every tensor from rank 0 in `joined.tensors` order (into device memory
    with NCCL, host memory with gloo), an adapter merged onto its base, then loaded as `version`;
    the bytes received."""
    from astrai.model.lora import merged_weight
    from astrai.model.weight_broadcast import broadcast, receive_buffer

    def receive() -> int:
        own = engine.model.state_dict()
        device = next(engine.model.parameters()).device
        received, num_bytes = {}, 0
        for name, (dtype, shape) in joined.tensors.items():
            buf = receive_buffer(shape, dtype, device, joined.backend)
            broadcast(joined.group, buf, joined.timeout_s, joined.backend)
            received[name] = buf
            num_bytes += buf.numel() * buf.element_size()
        if joined.base:  # an adapter: each base weight it changes, merged as the trainer merges it
            layers = {w: w.removesuffix("weight") for w in joined.base}
            merged = {w: merged_weight(joined.base[w].to(device), received[layer + "lora_A"].to(device),
                                       received[layer + "lora_B"].to(device), joined.scaling)
                      for w, layer in layers.items()}
            received = {**own, **merged}
        engine.load_weights(received, version)
        return num_bytes

    return receive


@router.post("/v1/load_weights")
async def load_weights(request: Request) -> Response:
    state, engine, req = await _admin_request(request, LoadWeightsRequest)
    if req.transport == "broadcast":
        joined = state.weight_group
        if joined is None:
            raise APIError(409, "no weight group: POST /v1/weight_group first (the trainer does it at start)",
                           code="no_weight_group")
        start = time.perf_counter()
        try:
            num_bytes = await engine.run_between_steps(broadcast_receiver(joined, engine.engine, req.policy_version))
        except Exception as exc:  # noqa: BLE001 - a collective that failed or timed out: the group is dropped
            from astrai.model.weight_broadcast import abort, first_line

            abort(joined.group)
            if state.weight_group is joined:
                state.weight_group = None
            raise APIError(500, f"receiving policy version {req.policy_version} (broadcast transport, "
                                f"{joined.backend}) failed: {first_line(exc)}", type_="internal_error") from None
        return JSONResponse({"policy_version": req.policy_version, "transport": "broadcast", "backend": joined.backend,
                             "bytes": num_bytes, "seconds": round(time.perf_counter() - start, 4)})
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
