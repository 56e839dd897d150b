"""Written files follow the process umask: model directories and training checkpoints alike
(`safetensors_io` chmods what `save_file` writes through its private temporary file)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from astrai.data.tokenizer_training import train_tokenizer
from astrai.model.config import ModelConfig
from astrai.model.hf import save_model
from astrai.model.transformer import CausalLM

TINY = dict(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=64)


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield 0o027
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_model_directories_follow_the_umask(tmp_path, umask_027):
    tok = train_tokenizer(["hello world hello there"] * 4, vocab_size=261)
    path = save_model(CausalLM(ModelConfig(**TINY), seed=0), tmp_path / "m", tokenizer=tok)
    modes = _modes(path)
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert {name: mode for name, mode in modes.items() if mode != (0o750 if name == "." else 0o640)} == {}


def test_training_checkpoints_follow_the_umask(tmp_path, umask_027):
    from astrai.train.checkpoint import save_training_checkpoint
    from astrai.train.publish import wait_for_publish

    model = CausalLM(ModelConfig(**TINY), seed=0)
    optimizer = __import__("torch").optim.AdamW(model.parameters())
    path = save_training_checkpoint(tmp_path / "ckpt", 1, model=model, tokenizer=None, optimizer=optimizer,
                                    scheduler=None, trainer_state={"step": 1}, extra_state={},
                                    metrics_path=None, keep_last=None, background=False)
    wait_for_publish()
    modes = _modes(Path(path))
    assert {"model.safetensors", "optimizer.pt", "manifest.json"} <= set(modes)
    assert {name: mode for name, mode in modes.items() if mode != (0o750 if name == "." else 0o640)} == {}
