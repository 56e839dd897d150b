"""SequenceClassifier: a reward model as it trains and as transformers loads it (one label).

The trunk is the policy's ``Transformer`` and the head is transformers' ``score`` (a bias-free
``Linear(hidden, 1)``), so the state dict's names are already the file's: ``model.*`` and
``score.weight``. ``train_type: reward`` trains one (``train/objectives/reward_model.py``), built
from a causal LM's trunk (``from_causal_lm``: a fresh seeded head) or loaded from a reward model
directory (``load_classifier``); ``save_classifier`` writes a Hugging Face sequence-classification
directory (``<Family>ForSequenceClassification``, ``id2label`` with one label, ``pad_token_id``)
that ``transformers.AutoModelForSequenceClassification`` loads with the same scores, and that
``ValueModel.from_pretrained`` reads as it is (``rewards: [DIR]``, ``critic_model_path``). Under
LoRA the ``score`` head trains whole beside the adapters and a checkpoint is a PEFT ``SEQ_CLS``
adapter directory (``model/lora.py``); ``load_classifier`` loads one on its base, merged.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from astrai.model.config import ModelConfig
from astrai.model.transformer import CausalLM, Transformer, WithTrunk


class SequenceClassifier(WithTrunk):
    # LoRA (model/lora.py): the head trains whole and is saved with the adapters, as PEFT's SEQ_CLS does
    peft_task_type = "SEQ_CLS"
    peft_modules_to_save = ("score",)

    def __init__(self, config: ModelConfig, seed: int | None = 0, trunk: Transformer | None = None) -> None:
        """A classifier with a fresh trunk (seeded like CausalLM), or around `trunk`; the head is
        drawn from N(0, initializer_range^2) with `seed` (transformers' init of ``score``)."""
        super().__init__()
        # no lm_head here: a tied embedding would name a tensor the directory never holds
        self.config = dataclasses.replace(config, tie_word_embeddings=False)
        if trunk is None:
            trunk = CausalLM(config, seed=seed).model
        self.model = trunk
        ref = next(trunk.parameters())
        self.score = nn.Linear(config.hidden_size, 1, bias=False, device=ref.device, dtype=ref.dtype)
        gen = torch.Generator().manual_seed(0 if seed is None else seed)
        with torch.no_grad():
            init = torch.randn(1, config.hidden_size, generator=gen) * config.initializer_range
            self.score.weight.copy_(init.to(ref.dtype))

    @classmethod
    def from_causal_lm(cls, lm: CausalLM, seed: int = 0) -> SequenceClassifier:
        """A classifier on `lm`'s trunk (shared, not copied: the LM head is dropped)."""
        if not isinstance(getattr(lm, "model", None), Transformer):
            raise TypeError(f"from_causal_lm needs a CausalLM, got {type(lm).__name__}")
        return cls(lm.config, seed=seed, trunk=lm.model)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, document_ids: Tensor | None = None,
                prefix_ids: Tensor | None = None) -> Tensor:
        """input_ids (B, T) -> scores (B, T) in float32, one per token: a sequence's score is the
        one at its last token (transformers reads the last non-padding token); `document_ids` and
        `prefix_ids`: packed rows and shared prefixes (``Transformer.forward``)."""
        hidden, _, _, _ = self.model(input_ids, attention_mask, position_ids, document_ids,
                                     prefix_ids=prefix_ids)  # (B, T, C)
        return self.score(hidden).squeeze(-1).float()  # (B, T)


def is_classifier_dir(path: str | Path) -> bool:
    """Whether a model directory holds a scalar ``score`` head (a sequence-classification model)."""
    from astrai.model.safetensors_io import read_json

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return "score.weight" in read_json(index).get("weight_map", {})
    file = path / "model.safetensors"
    if not file.is_file():
        return False
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return "score.weight" in f.keys()


def load_classifier(path: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> SequenceClassifier:
    """A classifier from a model directory: a sequence-classification directory keeps its
    ``score`` head; a causal LM directory gives its trunk and a fresh head seeded with `seed`; a
    PEFT ``SEQ_CLS`` adapter directory (a LoRA reward run's checkpoint) loads its base (either of
    those) with the adapter merged and its own ``score`` head."""
    from astrai.model.hf_dir import load_config, load_model_dir
    from astrai.model.hf_weights import state_dict_from_hf
    from astrai.model.lora import is_adapter_dir, load_adapter, merge_lora, resolve_base
    from astrai.model.manifest import check_model_dir
    from astrai.model.safetensors_io import read_safetensors

    path = Path(path)
    if is_adapter_dir(path) and not (path / "config.json").is_file():
        model = load_classifier(resolve_base(path), seed, dtype)
        load_adapter(model, path)
        return merge_lora(model)
    if not is_classifier_dir(path):
        return SequenceClassifier.from_causal_lm(load_model_dir(path, dtype), seed)
    check_model_dir(path)
    config = load_config(path)
    tensors = state_dict_from_hf(read_safetensors(path), config)
    weight = tensors.pop("score.weight")
    if tuple(weight.shape) != (1, config.hidden_size):
        raise ValueError(f"{path}: 'score.weight' has shape {tuple(weight.shape)}, expected (1, {config.hidden_size}); "
                         "a reward model has one label")
    model = SequenceClassifier(config, seed=None)
    trunk = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    model.model.load_state_dict(trunk)
    with torch.no_grad():
        model.score.weight.copy_(weight)
    return model.to(dtype)


def save_classifier(model: SequenceClassifier, path: str | Path, tokenizer: Any | None = None,
                    state_dict: dict[str, Tensor] | None = None) -> Path:
    """Write `model` as a transformers sequence-classification directory with one label: the
    causal LM directory format (``hf_dir.save_model_dir``: weights, tokenizer) with the family's
    ``ForSequenceClassification`` architecture and ``id2label`` in config.json, and the pad id
    transformers needs to find a padded row's last token."""
    from astrai.model.hf_dir import save_model_dir

    path = save_model_dir(model, path, tokenizer, state_dict=state_dict)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = [config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
    config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    if config.get("pad_token_id") is None and tokenizer is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        config["pad_token_id"] = pad
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return path
