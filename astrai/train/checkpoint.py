"""Crash-safe training checkpoints: atomic publish, manifest, verify, latest-complete lookup, retention.

Sits at the end of the training data flow: the checkpoint callback calls
`save_training_checkpoint` after an optimizer step, and `--resume` calls
`load_training_checkpoint` before the first one. The file layer (`publish`) knows nothing of
models: it runs a writer into a hidden staging directory, fsyncs every file, writes
`manifest.json` (size and sha256 of each file) last, renames the directory into place and fsyncs
the parent, so `<ckpt_dir>/step_<N:08d>/` either is complete or does not exist, whenever the
process dies. Hidden `.step_*` siblings (staging, retired, deleting) never count and are
cleaned up at the next start. Layout and manifest are fixed by DESIGN.md 3.2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from astrai.train import dist

FORMAT = "astrai-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
# hidden siblings: .step_00000010.staging-<pid>, .retired-<pid>, .deleting-<pid>
HIDDEN_DIR = re.compile(r"^\.(step_\d{8,})\.(staging|retired|deleting)-\d+$")
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the directory and file."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# --------------------------------------------------------------------------------- file layer


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _file_entry(path: Path) -> dict[str, Any]:
    digest, size = _hash_file(path)
    return {"size": size, "sha256": digest}


def _file_names(root: Path) -> list[str]:
    names = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    return sorted(n for n in names if n != MANIFEST)


def _remove(path: Path) -> None:
    """Delete a checkpoint-like directory: rename it hidden first, so a crash mid-delete
    never leaves a half-deleted directory under its public name."""
    doomed = path.parent / f".{path.name}.deleting-{os.getpid()}"
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


class _Pending:
    thread: threading.Thread | None = None
    error: BaseException | None = None


def wait_for_publish() -> None:
    """Block until a background publish has finished; re-raise its error, if any."""
    if _Pending.thread is not None:
        _Pending.thread.join()
        _Pending.thread = None
    error, _Pending.error = _Pending.error, None
    if error is not None:
        raise error


def publish(
    ckpt_dir: str | os.PathLike,
    step: int,
    write_fn: Callable[[Path], None],
    keep_last: int | None = None,
    background: bool = False,
) -> Path:
    """Write a checkpoint atomically as `<ckpt_dir>/step_<N:08d>` and return its path.

    `write_fn(staging_dir)` writes the files. An existing directory of the same step is
    replaced (retired under a hidden name, then removed). With `keep_last`, older complete
    checkpoints beyond the newest `keep_last` are deleted after the new one is in place.
    With `background=True` only `write_fn` runs on the caller's thread; hashing, fsync, the
    rename and retention finish on a thread (the caller trains on meanwhile), and the path
    appears once they are done. The next publish, and `wait_for_publish`, wait for it first.
    A crash in the meantime leaves only a hidden staging directory: the previous checkpoint
    stays the newest complete one.
    """
    wait_for_publish()  # publishes happen one at a time, in order
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = step_dir_name(step)
    final = ckpt_dir / name
    staging = ckpt_dir / f".{name}.staging-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()

    try:
        write_fn(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not background:
        _finish(staging, final, step, keep_last)
        return final

    def run() -> None:
        try:
            _finish(staging, final, step, keep_last)
        except BaseException as e:  # surfaces at the next publish or wait_for_publish
            _Pending.error = e

    # not a daemon: an interpreter that exits normally completes the publish first
    _Pending.thread = threading.Thread(target=run, name=f"publish-{final.name}")
    _Pending.thread.start()
    return final


def _finish(staging: Path, final: Path, step: int, keep_last: int | None) -> None:
    """Seal the staging directory and move it into place (the atomic part of publish)."""
    ckpt_dir, name = final.parent, final.name
    try:
        _seal(staging, step)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    retired = None
    if final.exists():
        retired = ckpt_dir / f".{name}.retired-{os.getpid()}"
        shutil.rmtree(retired, ignore_errors=True)  # a leftover of an earlier process with this pid
        os.replace(final, retired)
    os.replace(staging, final)
    _fsync_dir(ckpt_dir)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
    if keep_last is not None:
        _apply_retention(ckpt_dir, keep_last, keep=final)


def _seal(staging: Path, step: int) -> None:
    """fsync every file and directory of `staging`, then write and fsync the manifest."""
    if (staging / MANIFEST).exists():
        raise CheckpointError(f"write_fn wrote {MANIFEST} into {staging}; the manifest is publish's own file")
    names = _file_names(staging)
    paths = [staging / n for n in names]
    # hashing (CPU, from the page cache) and fsync (disk) overlap; both release the GIL
    with ThreadPoolExecutor(max_workers=min(8, max(2, 2 * len(names)))) as pool:
        synced = [pool.submit(_fsync_file, p) for p in paths]
        entries = dict(zip(names, pool.map(_file_entry, paths)))
        for future in synced:
            future.result()
    for sub in {(staging / n).parent for n in names}:
        _fsync_dir(sub)
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "files": entries}
    with open(staging / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(staging)


def _apply_retention(ckpt_dir: Path, keep_last: int, keep: Path) -> None:
    complete = [p for _, p in list_checkpoints(ckpt_dir)]
    for path in complete[: max(0, len(complete) - keep_last)]:
        if path != keep:
            _remove(path)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed and schema-checked manifest of a checkpoint directory; CheckpointError if none."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path} has no {MANIFEST}; it is not a complete checkpoint")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mpath} is not valid JSON ({e}); the checkpoint is corrupt") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: 'format' must be {FORMAT!r}, got {manifest.get('format')!r}")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{mpath}: manifest version {manifest.get('version')!r} is not supported (this astrai reads "
            f"version {VERSION}); upgrade astrai"
        )
    files = manifest.get("files")
    if not isinstance(manifest.get("step"), int) or not isinstance(files, dict):
        raise CheckpointError(f"{mpath}: needs an integer 'step' and a 'files' mapping")
    for fname, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)):
            raise CheckpointError(f"{mpath}: entry for {fname!r} needs 'size' (int) and 'sha256' (hex)")
    return manifest


def verify_checkpoint(path: str | os.PathLike, checksums: bool = True) -> None:
    """Raise CheckpointError naming the first missing, resized or (with checksums) altered file."""
    path = Path(path)
    manifest = read_manifest(path)
    named = STEP_DIR.match(path.name)
    if named and int(named.group(1)) != manifest["step"]:
        raise CheckpointError(
            f"{path / MANIFEST} records step {manifest['step']} but the directory is {path.name}; "
            "a checkpoint directory must not be renamed"
        )
    for fname, entry in manifest["files"].items():
        fpath = path / fname
        if not fpath.is_file():
            raise CheckpointError(f"{fpath} is listed in {MANIFEST} but missing; the checkpoint is incomplete")
        size = fpath.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"{fpath} has {size} bytes, the manifest says {entry['size']}; the file is truncated or altered"
            )
        if checksums:
            digest, _ = _hash_file(fpath)
            if digest != entry["sha256"]:
                raise CheckpointError(
                    f"{fpath} fails its sha256 check (manifest {entry['sha256'][:12]}..., file {digest[:12]}...); "
                    "the file is corrupt, resume from an older checkpoint"
                )


def _hash_file(path: Path) -> tuple[str, int]:
    """sha256 hex digest and size of the bytes read."""
    digest, size = hashlib.sha256(), 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            digest.update(view[:n])  # hashlib drops the GIL on large buffers
            size += n
    return digest.hexdigest(), size


def is_complete(path: str | os.PathLike, checksums: bool = False) -> bool:
    try:
        verify_checkpoint(path, checksums=checksums)
    except CheckpointError:
        return False
    return True


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (manifest present, every file there with its size), oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `ckpt_dir`, or None. Hidden directories never count."""
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def find_resume_checkpoint(ckpt_dir: str | os.PathLike) -> Path:
    """The checkpoint `--resume` should continue from: the newest complete one in `ckpt_dir`.

    Raises CheckpointError naming the damaged file when checkpoints exist but none is complete
    (never a silent fresh start), and warns on stderr when newer damaged ones are skipped.
    """
    ckpt_dir = Path(ckpt_dir)
    public = sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and STEP_DIR.match(p.name)) if ckpt_dir.is_dir() else []
    latest = latest_checkpoint(ckpt_dir)
    damaged = []
    for p in public:
        if latest is None or p.name > latest.name:
            try:
                verify_checkpoint(p, checksums=False)
            except CheckpointError as e:
                damaged.append(str(e))
    if latest is None:
        if damaged:
            raise CheckpointError(f"no complete checkpoint to resume in {ckpt_dir}: {damaged[-1]}")
        raise CheckpointError(
            f"--resume found no checkpoint in {ckpt_dir}; start without --resume, or point --param_path at one"
        )
    for problem in damaged:
        print(f"warning: skipping a damaged checkpoint newer than {latest.name}: {problem}", file=sys.stderr)
    return latest


def cleanup_leftovers(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Finish what a killed publish left behind; call once at start (rank 0), before training.

    A step whose public directory is missing gets back its complete staged copy (the crash fell
    between retiring the old and renaming the new) or else its retired one; every other hidden
    staging/retired/deleting directory is removed. Returns the directories restored.
    """
    wait_for_publish()  # never mistake this process's own background publish for a leftover
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    hidden = sorted(
        (p for p in ckpt_dir.iterdir() if p.is_dir() and HIDDEN_DIR.match(p.name)),
        key=lambda p: {"staging": 0, "retired": 1, "deleting": 2}[HIDDEN_DIR.match(p.name).group(2)],
    )
    restored = []
    for p in hidden:
        name, kind = HIDDEN_DIR.match(p.name).groups()
        final = ckpt_dir / name
        if kind != "deleting" and not final.exists() and is_complete(p, checksums=True):
            os.replace(p, final)
            restored.append(final)
        else:
            shutil.rmtree(p, ignore_errors=True)
    if hidden:
        _fsync_dir(ckpt_dir)
    return restored


# ----------------------------------------------------------------------------- training state

TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
METRICS = "metrics.jsonl"


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
    metrics_path: str | os.PathLike | None = None,
    keep_last: int | None = None,
    background: bool = False,
) -> Path:
    """Publish the full training state as checkpoint `step`. Collective: every rank calls it.

    Writes the model directory (`astrai.save_model`), `optimizer.pt` (keyed by parameter name,
    unsharded, so any world size can load it), `scheduler.pt`, `trainer_state.json`, a copy of
    `metrics_path` as `metrics.jsonl`, and `<name>.pt` for each `extra_state` entry (already
    full state dicts, e.g. the PPO critic). Sharded state is gathered to rank 0, which writes;
    every rank returns the published path, or raises if rank 0 failed. `background=True` hashes,
    fsyncs and renames on a thread (see `publish`); call `wait_for_publish()` before exiting.
    """
    from astrai.model.hf import save_model

    # gathers are collectives: every rank takes part, rank 0 receives the CPU tensors
    model_state = dist.full_model_state_dict(model) if dist.is_fsdp(model) else None
    optim_state = dist.full_optimizer_state_dict(model, optimizer) if optimizer is not None else None
    final = Path(ckpt_dir) / step_dir_name(step)
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            state_json = _dump_json(trainer_state)

            def write(staging: Path) -> None:
                save_model(dist.unwrap_model(model), staging, tokenizer, state_dict=model_state)
                if optim_state is not None:
                    torch.save(optim_state, staging / OPTIMIZER)
                if scheduler is not None:
                    torch.save(scheduler.state_dict(), staging / SCHEDULER)
                for name, state in (extra_state or {}).items():
                    torch.save(state, staging / f"{name}.pt")
                (staging / TRAINER_STATE).write_text(state_json)
                if metrics_path is not None and Path(metrics_path).is_file():
                    shutil.copyfile(metrics_path, staging / METRICS)

            final = publish(ckpt_dir, step, write, keep_last, background=background)
        except BaseException as e:  # re-raised below, once the other ranks know
            error = e
    if dist.any_rank(error is not None):  # doubles as the barrier that ends the save
        raise error or CheckpointError(f"rank 0 failed to publish {final}; see its log")
    return final


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
    from astrai.model.hf import read_safetensors, state_dict_from_hf

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


# ---------------------------------------------------------------------------------------- CLI


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _cmd_list(ckpt_dir: Path, verify: bool = False) -> int:
    if not ckpt_dir.is_dir():
        print(f"astrai ckpt list: {ckpt_dir} is not a directory", file=sys.stderr)
        return 2
    rows = []
    for p in sorted(ckpt_dir.iterdir()):
        if p.is_dir() and (STEP_DIR.match(p.name) or HIDDEN_DIR.match(p.name)):
            if HIDDEN_DIR.match(p.name):
                status = "leftover (ignored; removed at the next start)"
            elif (p / MANIFEST).exists():
                status = "complete" if is_complete(p) else "INCOMPLETE"
                if verify and status == "complete":  # sizes match; --verify also reads every byte
                    status = "complete, verified" if is_complete(p, checksums=True) else "DAMAGED (checksum)"
            else:
                status = "legacy (no manifest)"
            rows.append(f"{p.name:<40} {_dir_bytes(p) / 1e6:>10.1f} MB  {status}")
    print("\n".join(rows) if rows else f"no checkpoints in {ckpt_dir}")
    latest = latest_checkpoint(ckpt_dir)
    print(f"latest complete: {latest.name if latest else 'none'}")
    return 0


def _cmd_verify(target: Path) -> int:
    if (target / MANIFEST).exists() or STEP_DIR.match(target.name):
        paths = [target]
    else:
        paths = sorted(p for p in target.iterdir() if p.is_dir() and STEP_DIR.match(p.name)) if target.is_dir() else []
        if not paths:
            print(f"astrai ckpt verify: no checkpoints in {target}", file=sys.stderr)
            return 2
    failed = 0
    for p in paths:
        try:
            verify_checkpoint(p)
            print(f"OK      {p} ({len(read_manifest(p)['files'])} files, {_dir_bytes(p) / 1e6:.1f} MB)")
        except CheckpointError as e:
            failed += 1
            print(f"FAILED  {e}")
    return 1 if failed else 0


def _cmd_latest(ckpt_dir: Path) -> int:
    """The checkpoint `--resume` (and the container entrypoint) would continue from."""
    try:
        print(find_resume_checkpoint(ckpt_dir))
    except CheckpointError as e:
        print(f"astrai ckpt latest: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="astrai ckpt", description="List, verify or pick training checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    list_cmd = sub.add_parser("list", help="checkpoints in a ckpt_dir, their size and status")
    list_cmd.add_argument("dir", type=Path)
    list_cmd.add_argument("--verify", action="store_true", help="also recompute checksums; mark damaged ones")
    sub.add_parser(
        "verify", help="recompute the checksums of one checkpoint, or of every checkpoint in a ckpt_dir"
    ).add_argument("dir", type=Path)
    sub.add_parser(
        "latest", help="print the newest complete checkpoint in a ckpt_dir (what --resume picks), or exit 1"
    ).add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "list":
        return _cmd_list(args.dir, args.verify)
    commands = {"verify": _cmd_verify, "latest": _cmd_latest}
    return commands[args.command](args.dir)


if __name__ == "__main__":
    raise SystemExit(main())
