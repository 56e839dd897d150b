"""Training checkpoints: the full training state saved and restored.

Sits at the end of the training data flow: the checkpoint callback calls
`save_training_checkpoint` after an optimizer step, and `--resume` calls
`load_training_checkpoint` before the first one; `checkpoint_to_resume` picks which (the one
finder, `astrai.model.manifest.newest_checkpoint`, at the "checksums" level with the files the
train type needs). The files are published by the atomic protocol of `train/publish.py`
(staging, manifest, fsync, rename, retention); the `astrai ckpt` command is ckpt_cli.py. A
checkpoint holding a non-finite weight or optimizer value is never published. What differs by rank (online RL's rollouts) is one file per rank, each rank loading
its own; everything else is one full, unsharded copy.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from astrai.model.manifest import newest_checkpoint
from astrai.train import dist
from astrai.train.publish import (
    MANIFEST,
    CheckpointError,
    claim_ckpt_dir,
    cleanup_leftovers,
    publish,
    step_dir_name,
    verify_checkpoint,
    wait_for_publish,
)

# ----------------------------------------------------------------------------- training state

TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
METRICS = "metrics.jsonl"


# files a checkpoint of these train types must list to be resumable (the PPO critic, upstream names)
REQUIRED_EXTRAS = {"online_ppo": ("value_model.pt", "value_optimizer.pt")}


def required_files(path: Path) -> tuple[str, ...]:
    """Files the checkpoint's train type needs to resume (e.g. the PPO critic), read from its
    trainer state; none when that is unreadable (loading then reports the file by name)."""
    try:
        train_type = json.loads((path / TRAINER_STATE).read_text())["config"]["data"]["train_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return ()
    return REQUIRED_EXTRAS.get(train_type, ())


def checkpoint_to_resume(ckpt_dir: str | os.PathLike, asker: str = "--resume") -> Path:
    """The checkpoint `--resume`, `astrai ckpt latest` and the container entrypoint continue from:
    `newest_checkpoint` at the "checksums" level, with the files its train type needs. Every kind
    of damage in a newer one (missing or truncated file, checksum mismatch, bad manifest, missing
    critic files) is skipped the same way, with a warning naming the file; checkpoints that exist
    but are all damaged are a CheckpointError naming the newest damage, never a silent fresh start."""
    found = newest_checkpoint(ckpt_dir, "checksums", required=required_files)
    if found.path is None and found.skipped:
        raise CheckpointError(f"no complete checkpoint to resume in {ckpt_dir}: {found.skipped[0]}")
    if found.path is None and asker != "--resume":  # `astrai ckpt latest DIR`
        why = "no step_* directory in it" if Path(ckpt_dir).is_dir() else "it does not exist"
        raise CheckpointError(f"no checkpoint in {ckpt_dir} ({why}); check the path")
    if found.path is None:
        raise CheckpointError(
            f"--resume found no checkpoint in {ckpt_dir}; start without --resume, or point --param_path at one"
        )
    for problem in reversed(found.skipped):  # oldest first: the last line names the one just above the pick
        print(f"warning: skipping a damaged checkpoint newer than {found.path.name}: {problem}", file=sys.stderr)
    return found.path


def prepare_ckpt_dir(cfg: Any) -> list[Path]:
    """A run's start, on every rank, inside rank 0's run lock: rank 0 finishes what a killed save
    left (`cleanup_leftovers`) and, for a fresh run (no --resume), claims the ckpt_dir
    (`claim_ckpt_dir`: another run's checkpoints are refused, or deleted with
    --overwrite_ckpt_dir). A refusal is raised on every rank, so no rank waits alone. Returns the
    checkpoints deleted (rank 0)."""
    removed: list[Path] = []
    problem = None
    if dist.get_rank() == 0:
        cleanup_leftovers(cfg.ckpt.ckpt_dir)  # staging dirs of a killed save; half-done republishes
        if not cfg.train.resume:
            try:
                removed = claim_ckpt_dir(cfg.ckpt.ckpt_dir, cfg.ckpt.overwrite_ckpt_dir, keep=cfg.train.param_path)
            except CheckpointError as e:
                problem = str(e)
        if removed:
            print(f"--overwrite_ckpt_dir: deleted {len(removed)} checkpoint(s) of an earlier run from "
                  f"{cfg.ckpt.ckpt_dir} ({removed[0].name} .. {removed[-1].name})", file=sys.stderr)
    problem = dist.broadcast_object(problem)
    if problem:
        raise CheckpointError(problem)
    return removed


def save_training_checkpoint(
    ckpt_dir: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    tokenizer: Any | None,
    optimizer: Any | None,
    scheduler: Any | None,
    trainer_state: dict[str, Any],
    extra_state: dict[str, dict[str, Any]] | None = None,
    rank_state: dict[str, dict[str, Any]] | None = None,
    metrics_path: str | os.PathLike | None = None,
    keep_last: int | None = None,
    background: bool = False,
    base_model_path: str | os.PathLike | None = None,
) -> Path:
    """Publish the full training state as checkpoint `step`. Collective: every rank calls it.

    Writes the model directory (`astrai.save_model`), `optimizer.pt` (keyed by parameter name,
    unsharded, so any world size can load it), `scheduler.pt`, `trainer_state.json`, a copy of
    `metrics_path` as `metrics.jsonl`, and `<name>.pt` for each `extra_state` entry (already
    full state dicts, e.g. the PPO critic). `rank_state` is this rank's own state (every rank
    passes its own, under the same names; online RL: the rollout each rank drew): gathered to rank
    0 and written one file per rank, `rank_file(name, rank)` (`<name>.pt` for rank 0, as in a
    one-rank checkpoint, `<name>_rank<R>.pt` for the others), sealed and checksummed with the
    rest; each rank loads its own (`load_rank_state`). A model with LoRA adapters is written as a
    PEFT adapter directory instead of a model directory (`adapter_config.json` naming
    `base_model_path` + `adapter_model.safetensors`, plus the tokenizer): the frozen base is never
    copied. Sharded state is gathered to rank 0, which writes; every rank returns the published path, or raises if rank 0 failed. `background=True` hashes,
    fsyncs and renames on a thread (see `publish`); call `wait_for_publish()` before exiting.
    """
    from astrai.model.hf import save_model
    from astrai.model.lora import has_lora, is_adapter_tensor, save_adapter

    # gathers are collectives: every rank takes part, rank 0 receives the CPU tensors
    model_state = dist.full_model_state_dict(model) if dist.is_fsdp(model) else None
    optim_state = dist.full_optimizer_state_dict(model, optimizer) if optimizer is not None else None
    # small per-rank states (a rollout each) come to rank 0, so one process writes the staging dir
    rank_states = dist.gather_objects(rank_state) if rank_state is not None else None
    final = Path(ckpt_dir) / step_dir_name(step)
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            bad = _first_nonfinite(model_state if model_state is not None else dist.unwrap_model(model).state_dict(),
                                   "model weight") or _first_nonfinite(optim_state, "optimizer state")
            for name, state in (extra_state or {}).items():
                bad = bad or _first_nonfinite(state, name)
            per_rank = {rank_file(name, r): state for r, states in enumerate(rank_states or [])
                        for name, state in states.items()}
            for name, state in per_rank.items():
                bad = bad or _first_nonfinite(state, name)
            if bad:
                raise CheckpointError(f"refusing to publish checkpoint step {step}: {bad} is not finite (NaN or "
                                      "inf); training diverged, the last published checkpoint stays the newest")
            state_json = _dump_json(trainer_state)
            # what the files will take, for a full disk's message (the tensors dominate)
            written = {k: v for k, v in (model_state if model_state is not None else dist.unwrap_model(model).state_dict()).items()
                       if not has_lora(model) or is_adapter_tensor(model, k)}
            num_bytes = sum(_tensor_bytes(s) for s in (written, optim_state, extra_state, per_rank))

            def write(staging: Path) -> None:
                if has_lora(model):
                    base = str(Path(base_model_path).resolve()) if base_model_path is not None else None
                    save_adapter(dist.unwrap_model(model), staging, base, state_dict=model_state, tokenizer=tokenizer)
                else:
                    save_model(dist.unwrap_model(model), staging, tokenizer, state_dict=model_state)
                if optim_state is not None:
                    torch.save(optim_state, staging / OPTIMIZER)
                if scheduler is not None:
                    torch.save(scheduler.state_dict(), staging / SCHEDULER)
                for name, state in (extra_state or {}).items():
                    torch.save(state, staging / f"{name}.pt")
                for name, state in per_rank.items():
                    torch.save(state, staging / name)
                (staging / TRAINER_STATE).write_text(state_json)
                if metrics_path is not None and Path(metrics_path).is_file():
                    shutil.copyfile(metrics_path, staging / METRICS)

            final = publish(ckpt_dir, step, write, keep_last, background=background, num_bytes=num_bytes)
        except BaseException as e:  # re-raised below, once the other ranks know
            error = e
    if dist.any_rank(error is not None):  # doubles as the barrier that ends the save
        raise error or CheckpointError(f"rank 0 failed to publish {final}; see its log")
    return final


def _first_nonfinite(state: Any, where: str) -> str | None:
    """The name of the first floating-point tensor in a (nested) state that holds NaN or inf."""
    if isinstance(state, torch.Tensor):
        return where if state.is_floating_point() and not bool(torch.isfinite(state).all()) else None
    if isinstance(state, float):
        return where if not math.isfinite(state) else None
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list | tuple) else ()
    for key, value in items:
        found = _first_nonfinite(value, f"{where} {key}")
        if found:
            return found
    return None


def _tensor_bytes(state: Any) -> int:
    """Bytes of every tensor in a (nested) state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    items = state.values() if isinstance(state, dict) else state if isinstance(state, list | tuple) else ()
    return sum(_tensor_bytes(v) for v in items)


def _dump_json(state: dict[str, Any]) -> str:
    try:
        return json.dumps(state, indent=1) + "\n"
    except TypeError as e:
        raise TypeError(f"trainer_state must be JSON-serialisable for {TRAINER_STATE}: {e}") from e


def load_training_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: Any | None,
    scheduler: Any | None,
    verify: bool = True,
    metrics_path: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Restore model, optimizer and scheduler from a checkpoint and return its trainer_state.

    `verify=True` recomputes the manifest's checksums first (rank 0, the verdict shared). A
    legacy directory without a manifest loads unverified. Every missing or unreadable file is a
    CheckpointError naming it: a resume never silently starts fresh. With `metrics_path`, the
    checkpoint's metrics.jsonl replaces it, so the log continues exactly at this step.
    """
    path = Path(path)
    wait_for_publish()  # a checkpoint this process is still publishing
    problem = None
    if dist.get_rank() == 0:
        problem = _check_loadable(path, verify, optimizer is not None, scheduler is not None)
    problem = dist.broadcast_object(problem)
    if problem:
        raise CheckpointError(problem)

    dist.load_full_model_state_dict(model, _read_model_weights(path, model))
    if optimizer is not None:
        dist.load_full_optimizer_state_dict(model, optimizer, _torch_load(path / OPTIMIZER))
    if scheduler is not None:
        scheduler.load_state_dict(_torch_load(path / SCHEDULER))
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / TRAINER_STATE} cannot be read ({e}); the checkpoint is corrupt") from e
    if metrics_path is not None and dist.get_rank() == 0:
        _restore_metrics(path / METRICS, Path(metrics_path))
    dist.barrier()
    return state


def load_extra_state(path: str | os.PathLike, name: str) -> dict[str, Any]:
    """An extra state saved by `save_training_checkpoint(extra_state={name: ...})`."""
    return _torch_load(Path(path) / f"{name}.pt")


def rank_file(name: str, rank: int) -> str:
    """The file of rank `rank`'s own state `name`: `<name>.pt` on rank 0 (the name a one-rank
    checkpoint has always used), `<name>_rank<R>.pt` on the others."""
    return f"{name}.pt" if rank == 0 else f"{name}_rank{rank}.pt"


def load_rank_state(path: str | os.PathLike, name: str, rank: int) -> dict[str, Any]:
    """Rank `rank`'s own state saved by `save_training_checkpoint(rank_state={name: ...})`."""
    return _torch_load(Path(path) / rank_file(name, rank))


def _check_loadable(path: Path, verify: bool, need_optimizer: bool, need_scheduler: bool) -> str | None:
    if not path.is_dir():
        return f"checkpoint {path} does not exist; pass an existing step_<N> directory or --ckpt_dir"
    try:
        if (path / MANIFEST).exists():
            verify_checkpoint(path, checksums=verify)
    except CheckpointError as e:
        return str(e)
    needed = [TRAINER_STATE] + [OPTIMIZER] * need_optimizer + [SCHEDULER] * need_scheduler
    for name in needed:
        if not (path / name).is_file():
            return (
                f"{path / name} is missing; {path} cannot resume a run (it may hold weights only: "
                "pass it as --param_path without --resume)"
            )
    return None


def _torch_load(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} cannot be loaded ({type(e).__name__}: {e}); the file is corrupt") from e


def _read_model_weights(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from astrai.model.hf_weights import state_dict_from_hf
    from astrai.model.lora import ADAPTER_WEIGHTS, from_peft_key, has_lora, is_adapter_dir, is_adapter_tensor
    from astrai.model.safetensors_io import read_safetensors

    if has_lora(model) != is_adapter_dir(path):
        raise CheckpointError(f"{path} holds {'a LoRA adapter' if is_adapter_dir(path) else 'full weights'} but this "
                              f"run {'trains' if has_lora(model) else 'does not train'} LoRA adapters; resume with "
                              "the lora_* settings of the run that wrote it")
    if has_lora(model):  # adapter-only checkpoint: the frozen base is the one the run was built on
        from safetensors.torch import load_file

        try:
            adapter = {from_peft_key(k): v for k, v in load_file(str(path / ADAPTER_WEIGHTS)).items()}
        except Exception as e:
            raise CheckpointError(f"{path / ADAPTER_WEIGHTS} cannot be read ({type(e).__name__}: {e})") from e
        state = dist.unwrap_model(model).state_dict()
        expected = {k for k in state if is_adapter_tensor(model, k)}
        if set(adapter) != expected:
            raise CheckpointError(f"{path / ADAPTER_WEIGHTS} does not match this run's adapters (missing "
                                  f"{sorted(expected - set(adapter))[:3]}, unexpected {sorted(set(adapter) - expected)[:3]}); "
                                  "resume with the lora_targets of the run that wrote it")
        return {**state, **adapter}
    config = dist.unwrap_model(model).config
    try:
        tensors = state_dict_from_hf(read_safetensors(path), config)
    except Exception as e:
        raise CheckpointError(f"model weights in {path} cannot be read ({type(e).__name__}: {e})") from e
    if config.tie_word_embeddings and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # the live model lists both
    return tensors


def _restore_metrics(saved: Path, target: Path) -> None:
    # replace atomically: a crash here must not leave a half-copied log
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if saved.is_file():
        shutil.copyfile(saved, tmp)
    else:
        tmp.write_text("")
    os.replace(tmp, target)
