"""The broadcast weight transport's shared half: one `torch.distributed` group between a trainer's
rank 0 and its rollout servers, and how a model's tensors cross it.

Both ends import this module and neither imports the other: the trainer's
``train/rl/http_sampler.py`` (rank 0, the sender) and the server's ``serve/admin.py`` (ranks
1..N). It fixes the backend (`choose_backend`: NCCL when the trainer's weights and every server's
are on CUDA and this torch has NCCL, gloo otherwise), where a tensor sits on the wire (`send_view`
and `receive_buffer`: with NCCL the weights' own CUDA memory, no host copy; with gloo a contiguous
host tensor), the group (`open_group`, a TCPStore rendezvous bounded by the timeout) and one
broadcast whose wait is bounded on the calling thread (`broadcast`), so a peer that never comes is a
`WeightBroadcastError` of one line within the timeout, on either backend, never a silent hang.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

BACKENDS = ("gloo", "nccl")
WIRE_DTYPES = ("float32", "bfloat16", "float16")  # what a weight group carries (dtype_name / wire_dtype)


class WeightBroadcastError(RuntimeError):
    """A weight-group rendezvous or broadcast that failed or timed out; the message is one line."""


def nccl_available() -> bool:
    """Whether this process can be a member of an NCCL group: a CUDA device and torch built with NCCL."""
    dist = torch.distributed
    return dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()


def backends_here(device: str | torch.device) -> list[str]:
    """The backends a member whose weights live on `device` can join."""
    return ["gloo", "nccl"] if torch.device(device).type == "cuda" and nccl_available() else ["gloo"]


def gpu_id(device: str | torch.device) -> str | None:
    """The physical GPU behind `device` (its UUID, the same whatever CUDA_VISIBLE_DEVICES says), or None."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def choose_backend(trainer_device: str | torch.device, server_backends: Iterable[Sequence[str]],
                   nccl: bool | None = None, gpus: Sequence[str | None] = ()) -> str:
    """NCCL when the trainer's weights are on CUDA, it has NCCL (`nccl`, default: `nccl_available()`)
    and every server can join an NCCL group (each server's `backends_here`); gloo otherwise (the CPU,
    or a mix: then every tensor crosses through host memory). `gpus` (every member's `gpu_id`): NCCL
    allows one rank per GPU, so two members on one GPU (a server beside the trainer) also get gloo."""
    nccl = nccl_available() if nccl is None else nccl
    known = [g for g in gpus if g is not None]
    if len(set(known)) < len(known):
        return "gloo"
    if nccl and torch.device(trainer_device).type == "cuda" and all("nccl" in b for b in server_backends):
        return "nccl"
    return "gloo"


def wire_device(backend: str, device: str | torch.device) -> torch.device:
    """Where a tensor of weights living on `device` is sent from or received into."""
    return torch.device(device) if backend == "nccl" else torch.device("cpu")


def send_view(tensor: Tensor, backend: str) -> Tensor:
    """What rank 0 broadcasts for `tensor`: the tensor itself on its own device for NCCL (a copy only
    when it is not contiguous), a contiguous host copy for gloo (none when it already is one)."""
    return tensor.detach().to(wire_device(backend, tensor.device)).contiguous()


def receive_buffer(shape: Sequence[int], dtype: torch.dtype, device: str | torch.device, backend: str) -> Tensor:
    """An empty tensor a member receives one broadcast into (for weights that live on `device`)."""
    return torch.empty(tuple(shape), dtype=dtype, device=wire_device(backend, device))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wire_dtype(name: str) -> torch.dtype:
    """The dtype a weight group's `dtype` names; ValueError naming the choices otherwise."""
    if name not in WIRE_DTYPES:
        raise ValueError(f"dtype '{name}' is not a weight dtype; expected one of {', '.join(WIRE_DTYPES)}")
    return getattr(torch, name)


def open_group(backend: str, addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """This process's member of the group: rank 0 hosts the TCPStore at addr:port, the others connect
    to it; the rendezvous and every collective are bounded by `timeout_s`. Blocks until every member
    joined (gloo); NCCL forms its communicator at the first broadcast."""
    if backend not in BACKENDS:
        raise ValueError(f"weight group backend '{backend}' is not one of {', '.join(BACKENDS)}")
    dist = torch.distributed
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(addr, port, world_size, rank == 0, timeout=timeout)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()  # absent from CPU builds: only reached with NCCL
            options._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, world_size, options)
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    except (RuntimeError, ValueError) as exc:  # the store's or the backend's: a timeout, a refused port
        raise WeightBroadcastError(f"forming the {backend} weight group at {addr}:{port} as rank {rank} of "
                                   f"{world_size} failed: {first_line(exc)}") from None


def broadcast(group: Any, tensor: Tensor, timeout_s: float, backend: str = "gloo") -> None:
    """`tensor` from rank 0 into every member's `tensor` (in place), waiting at most `timeout_s` on this
    thread: an explicit timeout makes even NCCL's wait block the CPU until done, instead of only
    ordering the stream. WeightBroadcastError (one line) when it fails or times out."""
    dist = torch.distributed
    if backend == "nccl":
        torch.cuda.set_device(tensor.device)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    try:
        done = group.broadcast([tensor], opts).wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise WeightBroadcastError(f"{backend} broadcast failed: {first_line(exc)}") from None
    if done is False:
        raise WeightBroadcastError(f"{backend} broadcast did not complete within {timeout_s:g} s")


def abort(group: Any) -> None:
    """Drop a group after a failed collective, so no backend thread waits on it (NCCL's watchdog would
    otherwise end the process at the group's timeout)."""
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - best effort: a group that cannot abort is dropped all the same
        pass


def first_line(exc: BaseException) -> str:
    """An exception's first non-empty line without the C++ source location c10d puts first
    (`[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer ...`)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return re.sub(r"^\[[^\]]*:\d+\]\s*", "", lines[0]) if lines else type(exc).__name__
