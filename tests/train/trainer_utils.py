"""Helpers for trainer tests: a tiny model, a config from flags, checkpoints switched off, a DPO
objective whose reference differs from its policy."""

from __future__ import annotations

import torch

from astrai.config import Config, load_config
from astrai.model import CausalLM, ModelConfig


def tiny_model(vocab: int = 32, seed: int = 0, **kw) -> CausalLM:
    cfg = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=2, max_position_embeddings=64)
    cfg.update(kw)
    return CausalLM(ModelConfig(**cfg), seed=seed)


def tiny_config(tmp_path, *flags: str) -> Config:
    """Flags on top of test defaults; checkpoints only when a test asks (ckpt_interval 0 and
    the end-of-run save is disabled by passing no_ckpt_callbacks)."""
    base = ["--log_dir", str(tmp_path / "log"), "--ckpt_dir", str(tmp_path / "ckpt"), "--ckpt_interval", "0",
            "--progress", "false", "--schedule", "constant"]
    return load_config(None, base + list(flags))


def without_checkpoints(trainer) -> None:
    """Drop the built-in checkpoint callback (tests of the loop, not of checkpoint files)."""
    from astrai.train.callbacks import CheckpointSaver

    trainer.callbacks.callbacks = [cb for cb in trainer.callbacks.callbacks if not isinstance(cb, CheckpointSaver)]


def dpo_with_a_moved_reference(loss_type: str, model_kwargs: dict):
    """(policy, dpo objective) on a fresh CausalLM(model_kwargs), its frozen reference nudged off the
    policy so the two differ."""
    from astrai.train.objectives import OBJECTIVES

    model = CausalLM(ModelConfig(**model_kwargs), seed=0)
    objective = OBJECTIVES["dpo"](load_config(None, ["--train_type", "dpo", "--loss_type", loss_type]), model)
    with torch.no_grad():  # a reference that differs from the policy
        for p in objective.reference.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model, objective
