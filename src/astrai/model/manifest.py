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
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
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
