"""Checkpoint manifests read from the model side: is a model directory whole before it loads?

A training checkpoint is also a model directory, with a `manifest.json` listing every file's
size and sha256 (DESIGN.md 3.2). Serving and generation (`astrai serve`, `astrai generate`,
`astrai.load_model`) call `check_model_dir` before reading weights: sizes always (cheap), sha256
when asked (`--verify`). A plain model directory without a manifest loads unchecked. This lives in
the model layer so the inference side can use it without importing `astrai.train`; the training
checkpoint code reads the same format.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{8,})$")  # <ckpt_dir>/step_<N:08d>, DESIGN.md 3.2
FORMAT = "astrai-checkpoint"
VERSION = 1
_CHUNK = 8 << 20


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
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), str)):
            raise ManifestError(f"{mpath}: entry for {name!r} needs 'size' (int) and 'sha256' (hex)")
    return manifest


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
    path = Path(path)
    manifest = read_manifest(path)
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
    return manifest


def check_model_dir(path: str | os.PathLike, verify: bool = False) -> bool:
    """Before loading a model directory: when it has a manifest, check every listed file's size
    and, with `verify`, its sha256. False for a directory without a manifest (nothing to check)."""
    if not (Path(path) / MANIFEST).exists():
        return False
    check_manifest_files(path, checksums=verify)
    return True


def latest_complete_checkpoint(ckpt_dir: str | os.PathLike) -> tuple[Path | None, str | None]:
    """(the newest `step_N` directory of a run's ckpt_dir whose manifest records step N and whose
    listed files are all there at their sizes, the problem of the newest damaged one skipped)."""
    steps = sorted((p for p in Path(ckpt_dir).iterdir() if p.is_dir() and STEP_DIR.match(p.name)), reverse=True)
    problem = None
    for path in steps:
        try:
            manifest = check_manifest_files(path)
            if manifest["step"] != int(STEP_DIR.match(path.name).group(1)):
                raise ManifestError(f"{path / MANIFEST} records step {manifest['step']}; the directory was renamed")
            return path, problem
        except ManifestError as e:
            problem = problem or str(e)
    return None, problem


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """What `--model` and `param_path` accept: a model or checkpoint directory as it is, or a run's
    ckpt_dir (step_N directories, no config.json), which stands for its newest complete checkpoint.
    A ckpt_dir whose checkpoints are all incomplete is a ManifestError naming the damage."""
    p = Path(path)
    if not p.is_dir() or (p / "config.json").exists() or not any(STEP_DIR.match(c.name) for c in p.iterdir()):
        return p
    latest, problem = latest_complete_checkpoint(p)
    if latest is None:
        raise ManifestError(f"{p} holds checkpoints but none is complete ({problem}); point at a model "
                            "directory or another checkpoint")
    return latest


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
