"""Checkpoint manifests read from the model side: is a model directory whole, and which of a run's
checkpoints is the newest complete one?

A training checkpoint is also a model directory, with a `manifest.json` listing every file's
size and sha256 (DESIGN.md 3.2). Serving and generation (`astrai serve`, `astrai generate`,
`astrai.load_model`) call `check_model_dir` before reading weights: sizes always (cheap), sha256
by default up to `AUTO_VERIFY_MAX_BYTES` (under about a second of hashing), always with `--verify`,
never with `--no-verify`. A plain model directory without a manifest loads unchecked. The one
finder of "the newest complete checkpoint", `newest_checkpoint(ckpt_dir, level, required)`, lives
here too, with its level of checking explicit: `--model CKPT_DIR` asks it at "sizes", the
training side (`--resume`, `astrai ckpt latest`, the container entrypoint, retention) through
`train/publish.py` and `train/checkpoint.py`. This is the model layer, so the inference side uses
it without importing `astrai.train`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Literal, NamedTuple

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{8,})$")  # <ckpt_dir>/step_<N:08d>, DESIGN.md 3.2
FORMAT = "astrai-checkpoint"
VERSION = 1
_CHUNK = 8 << 20

# How far a checkpoint is checked; each level checks what the one before it does, and more.
LEVELS = ("manifest", "sizes", "checksums")
Level = Literal["manifest", "sizes", "checksums"]
# files a checkpoint's manifest must list: fixed names, or a function of the checkpoint directory
# (the training side reads the checkpoint's train type: an online_ppo run needs its critic)
Required = Collection[str] | Callable[[Path], Collection[str]]


class ManifestError(ValueError):
    """A model directory's manifest is unreadable, or a file it lists is missing, resized or altered."""


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed and schema-checked manifest.json of a directory; ManifestError naming the file."""
    mpath = Path(path) / MANIFEST
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{Path(path)} has no {MANIFEST}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{mpath} is not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ManifestError(f"{mpath}: 'format' must be {FORMAT!r}, got {got!r}")
    if manifest.get("version") != VERSION:
        raise ManifestError(f"{mpath}: manifest version {manifest.get('version')!r} is not supported "
                            f"(this astrai reads version {VERSION}); upgrade astrai")
    files = manifest.get("files")
    if not isinstance(manifest.get("step"), int) or not isinstance(files, dict):
        raise ManifestError(f"{mpath}: needs an integer 'step' and a 'files' mapping")
    for name, entry in files.items():
        if not name_is_inside(name):  # never read: verify would hash, and report on, a file of somebody else's
            raise ManifestError(f"{mpath}: entry {name!r} points outside the checkpoint; the checkpoint is damaged")
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), str)):
            raise ManifestError(f"{mpath}: entry for {name!r} needs 'size' (int) and 'sha256' (hex)")
    return manifest


def name_is_inside(name: str) -> bool:
    """Whether a manifest entry names a file inside its directory: a relative POSIX path without
    empty, '.' or '..' parts (publish writes every name so)."""
    return "\0" not in name and not name.startswith("/") and all(p not in ("", ".", "..") for p in name.split("/"))


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            digest.update(view[:n])  # hashlib drops the GIL on large buffers
    return digest.hexdigest()


def check_manifest_files(path: str | os.PathLike, checksums: bool = False) -> dict[str, Any]:
    """Raise ManifestError naming the first file that is missing, has another size than its
    manifest entry, or (with checksums) another sha256; return the manifest."""
    manifest = read_manifest(path)
    _check_files(Path(path), manifest, checksums)
    return manifest


def _check_files(path: Path, manifest: dict[str, Any], checksums: bool) -> None:
    for name, entry in manifest["files"].items():
        fpath = path / name
        if not fpath.is_file():
            raise ManifestError(f"{fpath} is listed in {MANIFEST} but missing; the checkpoint is incomplete")
        size = fpath.stat().st_size
        if size != entry["size"]:
            raise ManifestError(f"{fpath} has {size} bytes, {MANIFEST} says {entry['size']}; "
                                "the file is truncated or altered")
        if checksums:
            digest = sha256_file(fpath)
            if digest != entry["sha256"]:
                raise ManifestError(f"{fpath} fails its sha256 check ({MANIFEST} {entry['sha256'][:12]}..., "
                                    f"file {digest[:12]}...); the file is damaged, use another checkpoint")


# `verify=None` (the default of every load) hashes a manifest's files when they total at most this
# many bytes: sha256 measured at ~690 MB/s on one core of a 2-core CPU (warm page cache), so this
# costs under about 0.8 s; larger models are checked by size only unless `--verify` is given.
AUTO_VERIFY_MAX_BYTES = 512 * 2**20
VERIFY_HELP = ("recompute the sha256 checksums of a checkpoint's (and --lora adapter's) manifest.json before "
               f"loading; by default they are recomputed when the files total at most "
               f"{AUTO_VERIFY_MAX_BYTES >> 20} MiB, and --no-verify skips them (file sizes are always checked)")
# directories already checked in this process: (path, stat of every listed file) -> checksums done?
_checked: dict[tuple[str, tuple], bool] = {}


def _stat_key(path: Path, manifest: dict[str, Any]) -> tuple[str, tuple]:
    stats = []
    for name in sorted(manifest["files"]):
        st = (path / name).stat()
        stats.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return str(path.resolve()), tuple(stats)


def check_model_dir(path: str | os.PathLike, verify: bool | None = None) -> bool:
    """Before loading a model or adapter directory: when it has a manifest, check every listed
    file's size and its sha256: always with `verify=True`, never with False, and with None (the
    default) when the files total at most AUTO_VERIFY_MAX_BYTES. The first check of a directory in
    a process decides: a later default check of the same unchanged files (the load after a CLI's
    own `--verify` / `--no-verify` check) takes that decision instead of hashing again. False for a
    directory without a manifest (nothing to check)."""
    path = Path(path)
    if not (path / MANIFEST).exists():
        return False
    manifest = read_manifest(path)
    _check_files(path, manifest, checksums=False)  # sizes first: cheap, and names a truncated file
    key = _stat_key(path, manifest)
    if verify is None:
        verify = _checked[key] if key in _checked else \
            sum(e["size"] for e in manifest["files"].values()) <= AUTO_VERIFY_MAX_BYTES
    if verify and not _checked.get(key, False):
        _check_files(path, manifest, checksums=True)
    _checked[key] = _checked.get(key, False) or bool(verify)
    return True


def _check_level(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"checkpoint level must be one of {', '.join(LEVELS)}, got {level!r}")


def check_checkpoint(path: str | os.PathLike, level: Level, required: Required = ()) -> dict[str, Any]:
    """Raise ManifestError naming what keeps `path` from being a complete checkpoint at `level`;
    return its manifest. "manifest": a valid manifest.json whose step is the `step_N` directory's
    own; "sizes": also every listed file there at its size; "checksums": also at its sha256. At
    every level the manifest must list each of `required` (the files its train type needs)."""
    _check_level(level)
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except ManifestError as e:
        raise ManifestError(f"{e}; it is not a complete checkpoint") from None
    named = STEP_DIR.match(path.name)
    if named and int(named.group(1)) != manifest["step"]:
        raise ManifestError(f"{path / MANIFEST} records step {manifest['step']} but the directory is {path.name}; "
                            "a checkpoint directory must not be renamed")
    if level != "manifest":
        _check_files(path, manifest, checksums=level == "checksums")
    names = required(path) if callable(required) else required
    missing = [name for name in names if name not in manifest["files"]]
    if missing:
        raise ManifestError(f"{path} lacks {', '.join(missing)}, which its train type needs to resume")
    return manifest


def step_dirs(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """The public `step_N` directories of a run's ckpt_dir, complete or not, oldest first (none
    when it does not exist). Hidden `.step_*` staging and retired siblings never count."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


class Newest(NamedTuple):
    path: Path | None  # the newest step_N directory that passes, None when none does
    skipped: list[str]  # what is wrong with each newer one, newest first


def newest_checkpoint(ckpt_dir: str | os.PathLike, level: Level, required: Required = ()) -> Newest:
    """The newest checkpoint of a run's ckpt_dir that passes `check_checkpoint(path, level,
    required)`, and the problems of the newer ones it skipped. The one finder of "the newest
    complete checkpoint": `--model CKPT_DIR` and `publish.latest_checkpoint` ask at "sizes",
    `--resume` and `astrai ckpt latest` at "checksums" with the train type's required files."""
    _check_level(level)
    skipped = []
    for _, path in reversed(step_dirs(ckpt_dir)):
        try:
            check_checkpoint(path, level, required)
            return Newest(path, skipped)
        except ManifestError as e:
            skipped.append(str(e))
    return Newest(None, skipped)


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """What `--model` and `param_path` accept: a model or checkpoint directory as it is, or a run's
    ckpt_dir (step_N directories, no config.json), which stands for its newest complete checkpoint.
    A ckpt_dir whose checkpoints are all incomplete is a ManifestError naming the damage."""
    p = Path(path)
    if (p / "config.json").exists() or not step_dirs(p):
        return p
    latest, skipped = newest_checkpoint(p, "sizes")
    if latest is None:
        raise ManifestError(f"{p} holds checkpoints but none is complete ({skipped[0]}); point at a model "
                            "directory or another checkpoint")
    return latest


def nearest_model_dir(path: str | os.PathLike) -> str:
    """'; did you mean DIR?' for a `--model` that is no model directory, DIR the closest-named
    model or checkpoint folder beside it (a typo in the last part of the path), else ''."""
    import difflib

    p = Path(path)
    parent = p.parent if p.parent.is_dir() else None
    if parent is None or not p.name:
        return ""
    candidates = [c.name for c in parent.iterdir() if c.is_dir() and ((c / "config.json").exists() or step_dirs(c))]
    close = difflib.get_close_matches(p.name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {parent / close[0]}?" if close else ""


def model_argument(value: str, prog: str) -> str:
    """A command's `--model` value as a local directory (`astrai generate`, `chat`, `serve`, `eval`):
    a Hugging Face Hub id -> its cached snapshot (`hub.resolve_model_path`), a run's ckpt_dir -> its
    newest complete checkpoint (`resolve_model_dir`, said on stderr), anything else as it is."""
    import sys

    from astrai.model.hub import resolve_model_path

    local = resolve_model_path(value)
    resolved = resolve_model_dir(local)
    if resolved != Path(local):
        print(f"{prog}: --model {value} is a run's checkpoint folder; using its newest complete checkpoint "
              f"{resolved}", file=sys.stderr)
    return str(resolved)
