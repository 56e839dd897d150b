"""`load_model` / `save_model`: Hugging Face model directories, with LoRA adapters composed in.

The public face of the model layer's files (`astrai.load_model`, `astrai.save_model`), and the
top of the file side of the model layer: it sits above the directory format (hf_dir.py, which
knows nothing of adapters) and the adapters (lora.py), and is the one module that puts the two
together. A PEFT adapter directory, or a base directory with `lora=ADAPTER_DIR`, loads as its
base with the adapter merged; a model that still carries adapters saves as a plain directory
with them folded in. Nothing below imports this module. The format helpers live where they are
defined: `check_device`, `load_config`, `build_model` in hf_dir.py, `HFFormatError` in
hf_config.py, `read_safetensors` in safetensors_io.py, the tensor renames in hf_weights.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from astrai.model.classifier import SequenceClassifier, save_classifier
from astrai.model.hf_dir import check_device, load_model_dir, save_model_dir
from astrai.model.hub import resolve_model_path
from astrai.model.lora import is_adapter_dir, load_adapter, merge_lora, merged_state_dict, resolve_base
from astrai.model.safetensors_io import DEFAULT_MAX_SHARD_BYTES
from astrai.model.transformer import CausalLM


def load_model(
    path: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
    verify: bool | None = None, lora: str | Path | None = None,
) -> CausalLM:
    """A CausalLM from a HF model directory; built on the meta device, then given the weights.
    A checkpoint directory's manifest is checked first: file sizes always, sha256 with `verify`
    (None: when small enough to hash in about a second, `manifest.check_model_dir`).
    A PEFT adapter directory (a LoRA run's checkpoint) loads its base with the adapter merged,
    and so does a base directory with `lora=ADAPTER_DIR`. A Hugging Face Hub id (`org/name`) that
    is not a local path loads from the Hub cache (`model/hub.py`)."""
    path = Path(resolve_model_path(path, "model path"))
    check_device(device)
    if is_adapter_dir(path) and not (path / "config.json").is_file():
        return load_model(resolve_base(path), dtype=dtype, device=device, verify=verify, lora=path)
    model = load_model_dir(path, dtype, device, verify=verify)
    if lora is not None:
        load_adapter(model, lora, verify=verify)
        merge_lora(model)
    return model


def save_model(
    model: CausalLM,
    path: str | Path,
    tokenizer: Any | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    state_dict: dict[str, Tensor] | None = None,
) -> Path:
    """Write `model` as a HF model directory (config.json, safetensors, generation_config.json,
    and the tokenizer files when a tokenizer is given). `state_dict` overrides the model's own
    (e.g. a full state dict gathered from FSDP ranks); a model with LoRA adapters is written
    merged. generation_config.json's eos_token_id lists every id the tokenizer stops at (so
    transformers' `generate` ends a chat turn where astrai does), and the sampling defaults
    `load_model` found in the source directory (`model.generation_defaults`) are written back.
    A ``SequenceClassifier`` (a reward model) is written as transformers' sequence-classification
    directory (``model/classifier.py``)."""
    model = getattr(model, "module", model)  # DDP wrapper
    if isinstance(model, SequenceClassifier):  # a reward model: transformers' sequence-classification format
        return save_classifier(model, path, tokenizer, state_dict=state_dict)
    state = state_dict if state_dict is not None else model.state_dict()
    if any(k.endswith(".lora_A") for k in state):
        state = merged_state_dict(model)  # a LoRA run's checkpoint: fold adapters
    return save_model_dir(model, path, tokenizer, max_shard_bytes, state_dict=state)
