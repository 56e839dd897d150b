"""The model layer's file modules stack one way: safetensors_io <- hf_dir, lora <- hf.

hf.py composes "adapter directory = base + adapter" on top of the directory format (hf_dir.py)
and the adapters (lora.py); neither of those, nor the safetensors reader and writer below both,
imports hf.py or each other, at import time or inside a function. A damaged adapter file is
refused by the same reader as a damaged model file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import astrai
from astrai.model import hf
from astrai.model.config import ModelConfig
from astrai.model.hf_config import HFFormatError
from astrai.model.lora import ADAPTER_WEIGHTS, apply_lora, save_adapter
from astrai.model.transformer import CausalLM

MODEL_DIR = Path(astrai.__file__).parent / "model"
# module -> modules of the model layer it must never import (deferred imports included)
BELOW = {
    "safetensors_io": {"hf", "hf_dir", "lora"},
    "hf_dir": {"hf", "lora"},
    "lora": {"hf", "hf_dir"},
}


def model_imports(module: str) -> set[str]:
    tree = ast.parse((MODEL_DIR / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("astrai.model."):
            found.add(node.module.removeprefix("astrai.model."))
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("astrai.model.") for a in node.names if a.name.startswith("astrai.model."))
    return found


@pytest.mark.parametrize("module", sorted(BELOW))
def test_lower_file_modules_never_import_upward(module):
    assert not model_imports(module) & BELOW[module], f"model/{module}.py imports {model_imports(module) & BELOW[module]}"


def test_the_public_load_model_is_the_composing_one():
    assert astrai.load_model is hf.load_model and astrai.save_model is hf.save_model
    assert {"lora", "hf_dir"} <= model_imports("hf")


def test_damaged_adapter_file_is_an_error_naming_it(tmp_path):
    base = tmp_path / "base"
    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), seed=0)
    hf.save_model(model, base)
    apply_lora(model, r=2, targets=["q"])
    save_adapter(model, tmp_path / "ad", str(base))
    (tmp_path / "ad" / ADAPTER_WEIGHTS).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(HFFormatError, match=f"{tmp_path / 'ad' / ADAPTER_WEIGHTS} is damaged"):
        hf.load_model(tmp_path / "ad")
    assert torch.equal(hf.load_model(base).model.embed_tokens.weight, model.model.embed_tokens.weight)
