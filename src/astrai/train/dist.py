"""torch.distributed for the trainer: process group, DDP / FSDP2 wrapping, collectives, full state dicts.

Every helper works unchanged in a single process (no process group): collectives return their
input, wrapping returns the model, state dicts are the plain ones. The trainer calls
`init_distributed` once (ranks come from the RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT environment that `train/launch.py` or `torchrun` sets), wraps the model with
`wrap_model`, and `train/checkpoint.py` gathers full (unsharded) state dicts on rank 0 through
`full_model_state_dict` / `full_optimizer_state_dict`, so a checkpoint written by N ranks loads
with any other number of ranks; `gather_objects` brings each rank's small state (its rollout) to
rank 0 for the same checkpoint. `copy_full_weights` fills a plain replica with a sharded model's
full weights (FSDP online RL generates on it, see `train/rl/engine_sampler.py`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from astrai.config_values import CHOICES

PARALLEL_MODES = CHOICES["parallel_mode"]  # the config's closed choice; each is implemented here
# a collective that waits longer than this is a hang (a rank died or took another branch)
DEFAULT_TIMEOUT_S = 1800

_device = torch.device("cpu")  # where collectives put their tensors (cuda for nccl)
# Gloo frees a finished collective's tensors on its own worker thread. If Python has already
# dropped such a tensor, that free needs the GIL, and destroy_process_group (which joins the
# worker while holding the GIL) deadlocks. Keeping the last buffers referenced here avoids it.
_recent_buffers: deque[Tensor] = deque(maxlen=16)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when running as a single process

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def init_distributed(device: str | None = None, timeout_s: int = DEFAULT_TIMEOUT_S) -> DistInfo:
    """Join the process group described by the environment (gloo on CPU, nccl on CUDA).

    Without WORLD_SIZE (or with WORLD_SIZE=1) no process group is created. `device` forces
    "cpu" or "cuda"; by default CUDA is used when present.
    """
    global _device
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if device is not None and device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device={device!r} is not supported for training; use cpu or cuda (or leave it unset)")
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA device is available here; use --device cpu")
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))
        _device = torch.device("cuda", torch.cuda.current_device())
    else:
        _device = torch.device("cpu")
    if world_size <= 1 and not is_distributed():
        return DistInfo(0, 1, 0, _device, None)
    backend = "nccl" if use_cuda else "gloo"
    if not is_distributed():
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise RuntimeError(
                    f"WORLD_SIZE={world_size} but {key} is not set; start ranks with "
                    "`astrai train --nprocs N` or `torchrun`"
                )
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, _device, backend)


# ----------------------------------------------------------------------------------- wrapping


def wrap_model(model: nn.Module, parallel_mode: str, info: DistInfo) -> nn.Module:
    """Wrap for data parallelism: `none` (single process), `ddp`, or `fsdp` (FSDP2 `fully_shard`).

    FSDP2 shards each decoder block (`model.model.layers`) as its own unit and the rest at the
    root, so one block's parameters are gathered at a time.
    """
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"unknown parallel_mode {parallel_mode!r}; expected one of {list(PARALLEL_MODES)}")
    if info.world_size == 1:
        return model  # nothing to synchronise with; the same code path as one rank
    if parallel_mode == "none":
        raise ValueError(
            f"parallel_mode 'none' with {info.world_size} ranks would train {info.world_size} "
            "independent copies; use --parallel_mode ddp or fsdp"
        )
    if parallel_mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.fsdp import fully_shard

    for block in getattr(getattr(model, "model", None), "layers", []):
        fully_shard(block)
    fully_shard(model)
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 shards in place, so it is already that)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce inside the block (intermediate micro-steps of a window)."""
    if not enabled or not is_distributed():
        yield
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    elif is_fsdp(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


# -------------------------------------------------------------------------------- collectives


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def cleanup() -> None:
    """Leave the process group; the barrier first, so no rank tears down while others still talk."""
    if is_distributed():
        dist.barrier()
        time.sleep(0.05)  # let gloo's worker threads finish freeing the barrier's work (see above)
        dist.destroy_process_group()
    _recent_buffers.clear()


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum over ranks (a new tensor on the input's device); the input itself in one process."""
    if not is_distributed():
        return t
    buf = t.detach().to(_device, copy=True)
    _recent_buffers.append(buf)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf.to(t.device)


def all_reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Mean of each metric over ranks; every rank must pass the same keys."""
    if not is_distributed() or not metrics:
        return dict(metrics)
    keys = sorted(metrics)
    buf = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=_device)
    _recent_buffers.append(buf)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    buf /= dist.get_world_size()
    return dict(zip(keys, buf.tolist()))


def any_rank(flag: bool, group: Any = None) -> bool:
    """True on every rank when it is true on any rank (ranks agree on stopping); `group`: a gloo
    group of the ranks' own (a second thread's agreements), else the default group."""
    if not is_distributed():
        return bool(flag)
    buf = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device if group is None else "cpu")
    _recent_buffers.append(buf)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    return bool(buf.item())


def stop_agreed(ctx: Any) -> bool:
    """Whether to stop, the same answer on every rank: true when any rank's `ctx` asked to stop
    (the others then record "another rank stopped"). A collective when several ranks run."""
    if not is_distributed():
        return ctx.stop_requested
    stop = any_rank(ctx.stop_requested)
    if stop and not ctx.stop_requested:
        ctx.request_stop("another rank stopped")
    return stop


def autocast(device: torch.device, bf16: bool) -> Any:
    """bf16 autocast for forward passes when asked, else a no-op context."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def max_over_ranks(value: int) -> int:
    """The largest of every rank's `value` (e.g. micro-batches, so every rank runs as many)."""
    if not is_distributed():
        return int(value)
    buf = torch.tensor([int(value)], dtype=torch.int64, device=_device)
    _recent_buffers.append(buf)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return int(buf.item())


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s Python object on every rank (small objects: paths, flags)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's Python object in rank order on rank `dst`, None on the others (small objects:
    a rank's rollout for its checkpoint file). ``[obj]`` in one process. Collective."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


# ------------------------------------------------------------------------- full state dicts

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    # OptimizerList (Muon + AdamW) holds several; DCP merges them into one FQN-keyed dict
    return list(getattr(optimizer, "optimizers", [optimizer]))


def full_model_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Unsharded model state dict as CPU tensors on rank 0 (empty on other ranks). Collective."""
    return get_model_state_dict(model, options=_FULL)


def full_optimizer_state_dict(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Optimizer state keyed by parameter name (not index), unsharded, CPU, on rank 0. Collective."""
    return get_optimizer_state_dict(model, _optimizers(optimizer), options=_FULL)


@torch.no_grad()
def copy_full_weights(source: nn.Module, target: nn.Module) -> None:
    """Copy the full weights of `source` (plain, DDP or FSDP2-sharded) into `target`, a plain
    module of the same parameter and buffer names, on every rank. One tensor at a time: a sharded
    parameter is all-gathered (``DTensor.full_tensor``), copied and dropped, so the transient cost
    is the largest tensor, not a second model. Collective under FSDP: every rank calls it at the
    same point."""
    from torch.distributed.tensor import DTensor

    source = unwrap_model(source)
    into = {**dict(target.named_parameters()), **dict(target.named_buffers())}
    names = [n for n, _ in source.named_parameters()] + [n for n, _ in source.named_buffers()]
    if sorted(names) != sorted(into):
        missing, extra = sorted(set(names) - set(into)), sorted(set(into) - set(names))
        raise ValueError(f"cannot copy weights: the target lacks {missing[:3]} and has {extra[:3]} that the "
                         "source does not; build the target with the source's architecture")
    for name, value in [*source.named_parameters(), *source.named_buffers()]:
        full = value.full_tensor() if isinstance(value, DTensor) else value
        into[name].copy_(full.detach())


def load_full_model_state_dict(model: nn.Module, state_dict: dict[str, Tensor]) -> None:
    """Load a full state dict (every rank passes it) into a plain, DDP or FSDP2 model."""
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state_dict(model: nn.Module, optimizer: Any, state_dict: dict[str, Any]) -> None:
    """Load what `full_optimizer_state_dict` returned (every rank passes it), any world size."""
    set_optimizer_state_dict(
        model, _optimizers(optimizer), state_dict, options=StateDictOptions(full_state_dict=True)
    )
