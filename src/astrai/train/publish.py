"""The file-publish protocol of checkpoints: staging, fsync, manifest, atomic rename, retention.

Knows nothing of models or training: ``publish`` runs a writer into a hidden staging directory,
fsyncs every file, writes ``manifest.json`` (size and sha256 of each file) last, renames the
directory into place and fsyncs the parent, so ``<ckpt_dir>/step_<N:08d>/`` either is complete or
does not exist, whenever the process dies. Hidden ``.step_*`` siblings (staging, retired,
deleting) never count and are cleaned up at the next start. What "complete" means, and the one
finder of the newest complete checkpoint, live in ``astrai.model.manifest`` (``check_checkpoint``,
``newest_checkpoint``); ``verify_checkpoint``, ``list_checkpoints`` and ``latest_checkpoint`` apply
them here, with this module's error type. ``train/checkpoint.py`` builds the training state on
top of it. Layout and manifest are fixed by DESIGN.md 3.2.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from astrai.model import manifest as manifest_io
from astrai.train.signals import pause_point

FORMAT, VERSION, MANIFEST = manifest_io.FORMAT, manifest_io.VERSION, manifest_io.MANIFEST
STEP_DIR = manifest_io.STEP_DIR
# hidden siblings: .step_00000010.staging-<pid>, .retired-<pid>, .deleting-<pid>
HIDDEN_DIR = re.compile(r"^\.(step_\d{8,})\.(staging|retired|deleting)-\d+$")


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
    published: dict[str, Path] = {}  # ckpt_dir (resolved) -> the last checkpoint this process published there


def last_published(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint this process published in `ckpt_dir` that is still there (retention
    may have removed it), None when it published none: the run's own, whatever else the dir holds."""
    path = _Pending.published.get(str(Path(ckpt_dir).resolve()))
    return path if path is not None and path.is_dir() else None


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
    num_bytes: int | None = None,
) -> Path:
    """Write a checkpoint atomically as `<ckpt_dir>/step_<N:08d>` and return its path.

    `write_fn(staging_dir)` writes the files. An existing directory of the same step is
    replaced (retired under a hidden name, then removed). With `keep_last`, older complete
    checkpoints beyond the newest `keep_last` are deleted after the new one is in place.
    With `background=True` only `write_fn` runs on the caller's thread; hashing, fsync, the
    rename and retention finish on a thread (the caller trains on meanwhile), and the path
    appears once they are done. The next publish, and `wait_for_publish`, wait for it first.
    A crash in the meantime leaves only a hidden staging directory: the previous checkpoint
    stays the newest complete one. A full disk (ENOSPC, EDQUOT) removes the staging directory and
    is one CheckpointError naming the directory, the bytes needed (`num_bytes`, the caller's
    estimate, else the last checkpoint's size) and the bytes free.
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
    except BaseException as e:
        full = _disk_full(e, ckpt_dir, staging, num_bytes)
        shutil.rmtree(staging, ignore_errors=True)
        if full is not None:
            raise full from None
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


def publish_model_dir(final: str | os.PathLike, step: int, write_fn: Callable[[Path], None]) -> Path:
    """A model directory outside a ckpt_dir (a run's ``final/``) published as a checkpoint is:
    `write_fn(staging_dir)` writes the files into a hidden sibling, which is sealed with a manifest
    (sizes and sha256, `step` the checkpoint it came from) and renamed into place, replacing an
    older copy; loading it checks the manifest as for a checkpoint (``astrai.model.manifest``)."""
    wait_for_publish()
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        write_fn(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _finish(staging, final, step, keep_last=None)
    return final


def _finish(staging: Path, final: Path, step: int, keep_last: int | None) -> None:
    """Seal the staging directory and move it into place (the atomic part of publish)."""
    ckpt_dir, name = final.parent, final.name
    pause_point(f"publish-staged:{step}")  # test hook: files written, nothing sealed yet
    try:
        _seal(staging, step)
    except BaseException as e:
        full = _disk_full(e, ckpt_dir, staging, None)
        shutil.rmtree(staging, ignore_errors=True)
        if full is not None:
            raise full from None
        raise
    pause_point(f"publish-sealed:{step}")  # manifest written, not yet renamed into place
    retired = None
    if final.exists():
        retired = ckpt_dir / f".{name}.retired-{os.getpid()}"
        shutil.rmtree(retired, ignore_errors=True)  # a leftover of an earlier process with this pid
        os.replace(final, retired)
    os.replace(staging, final)
    _fsync_dir(ckpt_dir)
    _Pending.published[str(ckpt_dir.resolve())] = final
    pause_point(f"publish-renamed:{step}")  # public, before the retired copy and retention go
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
    if keep_last is not None:
        _apply_retention(ckpt_dir, keep_last, keep=final)


def _disk_full(error: BaseException, ckpt_dir: Path, staging: Path, num_bytes: int | None) -> CheckpointError | None:
    """The one-line error for a write that failed because the disk (or quota) is full, None for
    any other failure. torch.save and safetensors wrap the OSError, so its message counts too."""
    cause: BaseException | None = error
    while cause is not None and not (isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)):
        cause = cause.__cause__ or cause.__context__
    text = str(error)
    if cause is None and "No space left on device" not in text and "Disk quota exceeded" not in text:
        return None
    if num_bytes is None:  # the run's last checkpoint is as large as this one, else what was written
        previous = manifest_io.newest_checkpoint(ckpt_dir, "manifest").path
        num_bytes = _tree_bytes(previous) if previous is not None else _tree_bytes(staging)
    free = shutil.disk_usage(ckpt_dir).free + _tree_bytes(staging)  # the staging dir is about to go
    return CheckpointError(f"no space left in {ckpt_dir}: the checkpoint needs {num_bytes:,} bytes, {free:,} free; "
                           "free space or set --ckpt_dir (the last published checkpoint is intact)")


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


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
    """The parsed and schema-checked manifest of a checkpoint directory; CheckpointError if none.
    (The format is read by `astrai.model.manifest`, which serving uses too.)"""
    try:
        return manifest_io.read_manifest(path)
    except manifest_io.ManifestError as e:
        raise CheckpointError(f"{e}; it is not a complete checkpoint") from None


def verify_checkpoint(path: str | os.PathLike, checksums: bool = True) -> None:
    """Raise CheckpointError naming the first missing, resized or (with checksums) altered file."""
    try:
        manifest_io.check_checkpoint(path, "checksums" if checksums else "sizes")
    except manifest_io.ManifestError as e:
        raise CheckpointError(str(e)) from None


def _file_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": manifest_io.sha256_file(path)}


def is_complete(path: str | os.PathLike, checksums: bool = False) -> bool:
    try:
        verify_checkpoint(path, checksums=checksums)
    except CheckpointError:
        return False
    return True


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (manifest present, every file there with its size), oldest first."""
    return [(step, p) for step, p in manifest_io.step_dirs(ckpt_dir) if is_complete(p)]


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """Alias of the one finder at the "sizes" level, kept for its callers (summary, tests, benchmarks)."""
    return manifest_io.newest_checkpoint(ckpt_dir, "sizes").path


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


def claim_ckpt_dir(ckpt_dir: str | os.PathLike, overwrite: bool, keep: str | os.PathLike | None = None) -> list[Path]:
    """A fresh run's (no --resume) claim on its ckpt_dir, under the run lock: a directory that holds
    another run's step_N checkpoints is refused in one line naming --resume and
    --overwrite_ckpt_dir, since this run's saves would mix with them (retention would delete its
    own, "the newest" would be the old run's). With `overwrite` they are deleted (each renamed
    hidden first, as retention does) and returned; never when `keep` (the run's param_path) lies
    inside one of them."""
    ckpt_dir = Path(ckpt_dir)
    found = [p for _, p in manifest_io.step_dirs(ckpt_dir)]
    if not found:
        return []
    if not overwrite:
        raise CheckpointError(
            f"ckpt_dir {str(ckpt_dir)!r} already holds {len(found)} checkpoint(s) of an earlier run (newest "
            f"{found[-1].name}); continue that run with --resume, delete them with --overwrite_ckpt_dir, or give "
            "this run its own --ckpt_dir")
    if keep is not None:
        inside = [p for p in found if Path(keep).resolve().is_relative_to(p.resolve())]
        if inside:
            raise CheckpointError(f"--overwrite_ckpt_dir would delete {inside[0]}, which is this run's param_path; "
                                  "copy it elsewhere first or give this run its own --ckpt_dir")
    for path in found:
        _remove(path)
    _fsync_dir(ckpt_dir)
    return found


# ---------------------------------------------------------------------------------- run lock

LOCK_FILE = ".lock"


class CkptDirLocked(RuntimeError):
    """Another live run holds this ckpt_dir."""


@contextmanager
def run_lock(ckpt_dir: str | os.PathLike) -> Iterator[None]:
    """Hold `<ckpt_dir>/.lock` exclusively for a run's life: a second run on the same directory
    fails at once, naming the holder's pid and host. The kernel drops the lock when the holder's
    process ends in any way, so a crash never leaves a stale lock behind."""
    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        raise CheckpointError(f"ckpt_dir {str(ckpt_dir)!r} is a file, not a directory; give a directory path")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    lock = ckpt_dir / LOCK_FILE
    try:  # never through a symlink: the lock file is truncated and written, it must be this directory's own
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno == errno.EISDIR:
            raise CheckpointError(f"{lock} is a directory; a run's lock file must be a plain file in its ckpt_dir: "
                                  "remove the directory") from None
        if e.errno != errno.ELOOP and not lock.is_symlink():
            raise
        raise CheckpointError(f"{lock} is a symlink (to {os.readlink(lock)!r}); a run's lock file must be a plain "
                              "file in its ckpt_dir: remove the link") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(os.fstat(fd).st_mode) else "not a plain file"
            raise CheckpointError(f"{lock} is {kind}; a run's lock file must be a plain file in its ckpt_dir: "
                                  "remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"
            raise CkptDirLocked(
                f"ckpt_dir {str(ckpt_dir)!r} is in use by another run ({holder}); wait for it to end, stop it, "
                "or give this run its own --ckpt_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock
