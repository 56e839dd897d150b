"""A Hugging Face model directory without adapters: config.json + safetensors <-> CausalLM.

The format side of the model layer's border. `load_model_dir` reads a directory written by
transformers (or by astrai) for the families llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe
and mixtral: config.json becomes a `ModelConfig` (hf_config.py), the safetensors files
(safetensors_io.py) become a state dict mapped onto `CausalLM`'s names and layouts
(hf_weights.py), and generation_config.json's sampling defaults ride along on the model.
`save_model_dir` writes the same format back, choosing the family from the features the model
uses, so that `AutoModelForCausalLM.from_pretrained` loads it. A feature astrai does not
implement is an error naming the field and its value, and weights that do not match the model
exactly are an error listing the keys: nothing loads half-random. This module knows nothing of
LoRA; hf.py, above it and lora.py, composes the public `load_model` / `save_model` (an adapter
directory is its base plus the adapter) from these two.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from astrai.model.attention import rope_inv_freq
from astrai.model.config import ModelConfig
from astrai.model.hf_config import HFFormatError, config_from_hf, config_to_hf, pick_model_type
from astrai.model.hf_weights import fuse_experts, state_dict_from_hf, state_dict_to_hf
from astrai.model.manifest import check_model_dir
from astrai.model.safetensors_io import DEFAULT_MAX_SHARD_BYTES, read_json, read_safetensors, write_shards
from astrai.model.transformer import CausalLM

# generation_config.json's sampling defaults (HF names), carried from a loaded model to its saves
GENERATION_SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p",
                            "repetition_penalty", "max_new_tokens")


def check_device(device: torch.device | str | None) -> torch.device:
    """`device` as a torch.device, or a one-line ValueError when it is unknown or not available here."""
    if isinstance(device, torch.device):
        parsed = device
    else:
        try:
            parsed = torch.device(device or "cpu")
        except (RuntimeError, TypeError):
            raise ValueError(f"device {device!r} is unknown; use cpu, cuda, cuda:N or mps") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {str(device)!r} is not available: torch sees no CUDA GPU; use cpu")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"device {str(device)!r} is not available: torch sees {count} CUDA GPU(s), "
                             f"cuda:0..cuda:{count - 1}")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {str(device)!r} is not available on this machine; use cpu")
    elif parsed.type not in ("cpu", "cuda", "mps", "meta"):
        raise ValueError(f"device {str(device)!r} is not supported; use cpu, cuda, cuda:N or mps")
    return parsed


def _check_keys(tensors: dict[str, Tensor], expected: dict[str, Tensor], where: str) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise HFFormatError(
            f"weights in {where} do not match the model built from its config.json: "
            f"missing {len(missing)} {_abbrev(missing)}, unexpected {len(unexpected)} {_abbrev(unexpected)}"
        )
    wrong = [
        f"{k} {tuple(tensors[k].shape)} (expected {tuple(expected[k].shape)})"
        for k in expected if tensors[k].shape != expected[k].shape
    ]
    if wrong:
        raise HFFormatError(f"weights in {where} have the wrong shape: {_abbrev(wrong)}")


def _abbrev(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}]"


def load_config(path: str | Path) -> ModelConfig:
    """ModelConfig of a model directory (eos from generation_config.json when config lacks it)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} not found; a model directory needs config.json")
    raw = read_json(config_file)
    if not isinstance(raw, dict):
        raise HFFormatError(f"{config_file} is damaged: expected a JSON object, got {type(raw).__name__}")
    config = config_from_hf(raw)
    generation_file = path / "generation_config.json"
    if generation_file.exists():
        generation = read_json(generation_file)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(config, key) is None and generation.get(key) is not None:
                setattr(config, key, generation[key])
    return config


def resolve_dtype(dtype: torch.dtype | str | None, config: ModelConfig) -> torch.dtype:
    """None -> float32 (training precision); "auto" -> the dtype recorded in config.json."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = config.torch_dtype if dtype == "auto" else dtype
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype; use e.g. 'float32' or 'bfloat16'")
    return value


def load_generation_defaults(path: str | Path) -> dict[str, Any]:
    """The sampling defaults (temperature, top_p, ...) in a model directory's generation_config.json,
    with HF's names; {} when the file is absent or sets none."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    raw = read_json(file)
    if not isinstance(raw, dict):
        raise HFFormatError(f"{file} is damaged: expected a JSON object, got {type(raw).__name__}")
    return {k: raw[k] for k in GENERATION_SAMPLING_KEYS if raw.get(k) is not None}


def build_model(
    config: ModelConfig,
    tensors: dict[str, Tensor],
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    where: str = "the state dict",
) -> CausalLM:
    """CausalLM(config) holding exactly `tensors` (HF names/layouts); any key mismatch raises."""
    dtype = resolve_dtype(dtype, config)
    device = torch.device(device or "cpu")
    model = CausalLM(config, seed=None, device="meta")
    expected = {k: v for k, v in model.state_dict().items()
                if not (k == "lm_head.weight" and config.tie_word_embeddings)}
    tensors = fuse_experts(state_dict_from_hf(tensors, config), expected)
    _check_keys(tensors, expected, where)
    # assign=True adopts the loaded tensors: no second copy, no random init to overwrite
    tensors = {k: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
               for k, t in tensors.items()}
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    model.model.inv_freq = rope_inv_freq(config).to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise HFFormatError(f"tensors left uninitialised after loading {where}: {_abbrev(left)}")
    return model


def load_model_dir(
    path: Path, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
    verify: bool | None = None,
) -> CausalLM:
    """A CausalLM from a local HF model directory; built on the meta device, then given the
    weights. A checkpoint directory's manifest is checked first (`check_model_dir`): file sizes
    always, sha256 with `verify=True`, and by default (None) when the files are small enough to
    hash in under about a second."""
    check_model_dir(path, verify=verify)
    config = load_config(path)
    model = build_model(config, read_safetensors(path), dtype, device, where=str(path))
    # the source's sampling defaults travel with the weights, so a fine-tune's checkpoints keep them
    model.generation_defaults = load_generation_defaults(path)
    return model


def save_model_dir(
    model: CausalLM,
    path: str | Path,
    tokenizer: Any | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    state_dict: dict[str, Tensor] | None = None,
) -> Path:
    """Write `model` (unwrapped, adapters already folded into `state_dict`) as a HF model
    directory: config.json, safetensors, generation_config.json, and the tokenizer files when a
    tokenizer is given. `state_dict` overrides the model's own."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    model_type = pick_model_type(config)
    hf_config = config_to_hf(config, model_type)
    ids = _special_ids(config, tokenizer)
    hf_config.update(ids)
    state = state_dict if state_dict is not None else model.state_dict()
    tensors = state_dict_to_hf(state, config, model_type)
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    if floats:
        hf_config["dtype"] = str(floats[0]).removeprefix("torch.")
    write_shards(tensors, path, max_shard_bytes)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    write_generation_config(model, path, tokenizer)
    if tokenizer is not None:
        tokenizer.save(path)
    return path


def write_generation_config(model: CausalLM, path: str | Path, tokenizer: Any | None = None) -> None:
    """generation_config.json: bos/pad ids, an eos_token_id list naming every id the tokenizer stops
    at (transformers' `generate` then ends a chat turn at <|im_end|> as astrai does), and the
    sampling defaults in `model.generation_defaults`."""
    ids = _special_ids(model.config, tokenizer)
    generation = {k: v for k, v in ids.items() if v is not None}
    eos = _end_of_turn_ids(model.config, tokenizer)
    if len(eos) > 1:
        generation["eos_token_id"] = eos
    generation.update(getattr(model, "generation_defaults", None) or {})
    (Path(path) / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _special_ids(config: ModelConfig, tokenizer: Any | None) -> dict[str, Any]:
    """bos/eos/pad ids from the config, falling back to the tokenizer's."""
    out = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key)
        if value is None and tokenizer is not None:
            value = getattr(tokenizer, key, None)
        out[key] = value
    return out


def _end_of_turn_ids(config: ModelConfig, tokenizer: Any | None) -> list[int]:
    """The config's eos ids, then every id the tokenizer stops at (eos, the chat template's
    end-of-turn token, ...): what generation_config.json's eos_token_id lists."""
    ids = list(config.eos_token_ids)
    ids += list(getattr(tokenizer, "stop_token_ids", None) or [])
    if not ids and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return [i for i in dict.fromkeys(ids) if isinstance(i, int) and 0 <= i < config.vocab_size]

