"""safetensors files in and out: the one place the model layer reads and writes tensor files.

The bottom of the file side of the model layer. `read_safetensors` reads a model directory's
tensors (model.safetensors, or the shards named by model.safetensors.index.json) and
`read_safetensors_file` one file (a PEFT adapter's adapter_model.safetensors); a damaged file is
an `HFFormatError` naming it. `save_safetensors` writes one file with the mode of any other
file the process writes, and `write_shards` lays a state dict out as one file or numbered shards
plus the index. hf_dir.py (model directories) and lora.py (adapter directories) both sit on
this module; it knows nothing of models or adapters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from astrai.model.hf_config import HFFormatError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def read_json(file: Path) -> Any:
    """A JSON file of a model directory; a damaged one is an error naming it."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFFormatError(f"{file} is damaged: not valid JSON ({exc}); restore the file or point to "
                            "another model directory") from None


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """All tensors of a model directory: model.safetensors or the shards of its index."""
    path = Path(path)
    if (path / SAFE_INDEX).exists():
        weight_map = read_json(path / SAFE_INDEX)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / SAFE_WEIGHTS).exists():
        files = [SAFE_WEIGHTS]
    else:
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else "no such directory"
        raise FileNotFoundError(
            f"{path} has neither {SAFE_WEIGHTS} nor {SAFE_INDEX} (found: {found}); "
            "save the model with safetensors (transformers' save_pretrained does by default)"
        )
    tensors: dict[str, Tensor] = {}
    for name in files:
        tensors.update(read_safetensors_file(path / name))
    return tensors


def read_safetensors_file(file: str | Path) -> dict[str, Tensor]:
    """Every tensor of one safetensors file (on the CPU); damaged bytes are an HFFormatError."""
    tensors: dict[str, Tensor] = {}
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for bad bytes
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise HFFormatError(f"{file} is damaged and cannot be read ({reason}); "
                            "restore the file or point to another model directory") from None
    return tensors


def current_umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (the only portable way to read it)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, Tensor], file: str | Path) -> None:
    """safetensors' save_file, with the file's mode as any other file the process writes
    (0o666 & ~umask): save_file writes through a private temporary file (mode 0600)."""
    save_file(tensors, str(file), metadata={"format": "pt"})
    os.chmod(file, 0o666 & ~current_umask())


def write_shards(tensors: dict[str, Tensor], path: Path,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """One model.safetensors, or numbered shards plus model.safetensors.index.json."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    # files of an earlier save in another layout would shadow or confuse the new one
    for old in [*path.glob("model-*-of-*.safetensors"), path / SAFE_WEIGHTS, path / SAFE_INDEX]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        save_safetensors(shards[0], path / SAFE_WEIGHTS)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, path / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
