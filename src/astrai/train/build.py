"""Builders: a resolved ``Config`` -> tokenizer, model and datasets, for any training loop.

Sits before the loops in the training data flow: the offline trainer and the online RL loop both
call these when the caller does not hand in its own objects. ``param_path`` may name a model
directory, a checkpoint directory, or another run's ``ckpt_dir`` (its newest complete
checkpoint), so configs can chain stages. Which record kind a dataset reads is declared by the
train type's objective (``objectives.record_kind``); the data layer knows only record kinds.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from astrai.config import Config


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)



def build_tokenizer(cfg: Config) -> Any:
    """The tokenizer at tokenizer_path (default: param_path); None when neither is set."""
    path = cfg.data.tokenizer_path or cfg.train.param_path
    if path is None:
        return None
    path = resolve_param_path(path, "tokenizer_path" if cfg.data.tokenizer_path else "param_path")
    from astrai.data.tokenizer import load_tokenizer

    if not Path(path).exists():
        raise FileNotFoundError(f"tokenizer_path {str(path)!r} does not exist; check --tokenizer_path")
    return load_tokenizer(path)


def resolve_param_path(path: str, what: str = "param_path") -> str:
    """A model or checkpoint directory as it is; a ckpt_dir (holding step_N checkpoints) stands
    for its newest complete checkpoint, so a config can chain stages without knowing N; a Hugging
    Face Hub id (`org/name`) that is not a local path stands for its cached snapshot."""
    from astrai.model.hub import resolve_model_path
    from astrai.model.manifest import resolve_model_dir  # the rule `astrai generate --model` follows too

    path = resolve_model_path(path, what)
    resolved = resolve_model_dir(path)
    return path if resolved == Path(path) else str(resolved)


def build_model(cfg: Config) -> torch.nn.Module:
    """Weights from param_path (any checkpoint or model dir), else a fresh model from ``model:``;
    with ``lora_r > 0`` the base is frozen and only fresh adapters on ``lora_targets`` train."""
    model = _build_base(cfg)
    if cfg.lora.lora_r > 0:
        from astrai.model.lora import apply_lora

        if cfg.train.param_path is None:
            raise ValueError(f"lora_r={cfg.lora.lora_r} needs --param_path: the base model directory the adapter "
                             "trains on (its checkpoints name it as base_model_name_or_path)")
        apply_lora(model, cfg.lora.lora_r, cfg.lora.lora_alpha, cfg.lora.lora_dropout, cfg.lora.lora_targets)
    return model


def log_trainable(model: torch.nn.Module, is_main: bool = True) -> None:
    """The run's first log line: how many parameters train, and their share of the model."""
    from astrai.model.lora import count_parameters

    trainable, total = count_parameters(model)
    if is_main:
        print(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / max(total, 1):.2f}%)",
              file=sys.stderr, flush=True)


def _build_base(cfg: Config) -> torch.nn.Module:
    from astrai.model.config import ModelConfig
    from astrai.model.transformer import CausalLM

    if cfg.train.param_path is not None:
        from astrai.model.hf import load_model

        cfg.train.param_path = resolve_param_path(cfg.train.param_path)
        if not Path(cfg.train.param_path).is_dir():
            raise FileNotFoundError(f"param_path {cfg.train.param_path!r} is not a directory; "
                                    "give a model or checkpoint directory")
        extra = sorted(set(cfg.model) - {"router_aux_loss_coef"})
        if extra:
            raise ValueError(f"model fields {extra} are given together with param_path, whose config.json "
                             "defines the model; remove them or drop param_path")
        if cfg.lora.lora_r > 0 and (Path(cfg.train.param_path) / "adapter_config.json").is_file():
            raise ValueError(f"param_path {cfg.train.param_path!r} is a LoRA adapter; a LoRA run trains on a plain "
                             "base model: write one with `astrai lora merge` and pass that as --param_path")
        # fp32 master weights whatever the checkpoint's dtype; bf16 is an autocast option
        return load_model(cfg.train.param_path, dtype=torch.float32)
    if not cfg.model:
        raise ValueError("no model to train: give a 'model:' section (vocab_size, hidden_size, ...) "
                         "or --param_path DIR")
    return CausalLM(ModelConfig.from_dict(cfg.model), seed=cfg.train.random_seed)


class _Subset:
    """A view of some rows of a dataset that keeps its collate function."""

    def __init__(self, dataset: Any, indices: list[int]):
        self.dataset, self.indices = dataset, indices
        self.collate = dataset.collate

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.indices[i]]


def build_datasets(cfg: Config, tokenizer: Any) -> tuple[Any, Any]:
    """(train, val) datasets; val from val_data_path, else a seeded val_split of data_path, else None."""
    from astrai.data.datasets import build_dataset
    from astrai.data.hf_datasets import parse_dataset_path
    from astrai.train.types import record_kind

    d = cfg.data
    for name in ("data_path", "val_data_path"):
        path = getattr(d, name)
        if name == "data_path" and path is None:
            raise ValueError("data_path is not set; give --data_path FILE.jsonl, a preprocessed shard dir or a "
                             "dataset (hf:NAME@SPLIT, a save_to_disk dir)")
        if path is not None and parse_dataset_path(path) is None and not Path(path).exists():
            raise FileNotFoundError(f"{name} {path!r} does not exist; check --{name} (a dataset on the Hub is "
                                    f"written hf:{path})")
    if tokenizer is None and (Path(d.data_path).is_file() or parse_dataset_path(d.data_path) is not None):
        # shard dirs are already tokenized; JSONL and datasets are not
        raise ValueError("no tokenizer: set tokenizer_path (or param_path, whose directory holds one)")

    def build(path: str) -> Any:
        kind = record_kind(d.train_type)
        # prompts are checked against max_prompt_len at rollout time: skipped and counted there
        max_len = 1 << 30 if kind == "prompt" else d.max_seq_len
        return build_dataset(kind, path, tokenizer, max_len, pack=d.pack, stride=d.seq_stride, columns=d.data_columns)

    train = build(d.data_path)
    if d.val_data_path is not None:
        return train, build(d.val_data_path)
    if d.val_split > 0:
        g = torch.Generator().manual_seed(cfg.train.random_seed)
        order = torch.randperm(len(train), generator=g).tolist()
        n_val = max(1, round(d.val_split * len(train)))
        return _Subset(train, sorted(order[n_val:])), _Subset(train, sorted(order[:n_val]))
    return train, None


def check_vocab(model: torch.nn.Module, tokenizer: Any, cfg: Config) -> None:
    """Before any step: every token id the tokenizer can produce must have an embedding row."""
    if tokenizer is None:
        return
    model_vocab, size = model.config.vocab_size, len(tokenizer)
    if size > model_vocab:
        source = cfg.data.tokenizer_path or cfg.train.param_path
        raise ValueError(f"model vocab_size is {model_vocab} but the tokenizer at {source} has {size} tokens; "
                         f"set vocab_size to at least {size} (or use the model's own tokenizer)")
