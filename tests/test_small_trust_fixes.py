"""Small things that cost trust (issue 21 item 9): a tokenizer smaller than asked says why, written
files follow the umask, and `--model` takes a run's checkpoint folder."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from astrai.data.tokenizer_training import main as tokenizer_main
from astrai.data.tokenizer_training import train_tokenizer
from astrai.model.config import ModelConfig
from astrai.model.hf import save_model
from astrai.model.manifest import ManifestError, resolve_model_dir
from astrai.model.transformer import CausalLM

TINY = dict(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=64)


def test_a_vocabulary_smaller_than_asked_says_so_with_the_numbers(tmp_path, capsys):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("hello world\nhello there\n")
    assert tokenizer_main(["train", "--input", str(corpus), "--vocab-size", "512", "--out", str(tmp_path / "tok")]) == 0
    out, err = capsys.readouterr()
    # 256 bytes + 3 special tokens + the merges: "he", "hel", "hell", "hello" occur twice, nothing else does
    assert "vocab_size=263 (asked 512; see the warning above)" in out
    assert ("warning: the trained vocabulary has 263 tokens, not the 512 asked: after 4 merges no pair of tokens "
            "occurs 2 or more times (min_frequency) in the corpus of 2 texts, 24 characters; train on more text "
            "or lower --min_frequency") in err


def test_a_vocabulary_of_the_asked_size_prints_no_warning(tmp_path, capsys):
    train_tokenizer(["hello world hello there"] * 4, vocab_size=261)
    assert "warning" not in capsys.readouterr().err


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


def _checkpoints(tmp_path: Path, steps: list[int]) -> Path:
    from astrai.train.publish import publish

    model = CausalLM(ModelConfig(**TINY), seed=0)
    tok = train_tokenizer(["hello world hello there"] * 4, vocab_size=261)
    for step in steps:
        publish(tmp_path / "ckpt", step, lambda d: save_model(model, d, tokenizer=tok))
    return tmp_path / "ckpt"


def test_a_runs_ckpt_dir_stands_for_its_newest_complete_checkpoint(tmp_path):
    ckpt_dir = _checkpoints(tmp_path, [1, 2, 3])
    assert resolve_model_dir(ckpt_dir) == ckpt_dir / "step_00000003"
    (ckpt_dir / "step_00000003" / "model.safetensors").write_bytes(b"truncated")  # damaged: skipped
    assert resolve_model_dir(ckpt_dir) == ckpt_dir / "step_00000002"
    assert resolve_model_dir(ckpt_dir / "step_00000001") == ckpt_dir / "step_00000001"  # a checkpoint as it is
    assert resolve_model_dir(tmp_path / "nothing") == tmp_path / "nothing"  # the loader reports it
    for step in (1, 2):
        (ckpt_dir / f"step_{step:08d}" / "manifest.json").unlink()
    with pytest.raises(ManifestError, match="holds checkpoints but none is complete"):
        resolve_model_dir(ckpt_dir)


def test_generate_takes_a_runs_ckpt_dir(tmp_path, capsys):
    from astrai.infer.generate import main as generate_main

    ckpt_dir = _checkpoints(tmp_path, [1, 2])
    assert generate_main(["--model", str(ckpt_dir), "--prompt", "x", "--max-tokens", "2", "--temperature", "0",
                          "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert f"using its newest complete checkpoint {ckpt_dir / 'step_00000002'}" in err


@pytest.mark.parametrize("command", ["serve", "chat", "eval"])
def test_other_commands_resolve_a_runs_ckpt_dir_too(tmp_path, capsys, command):
    """Each command reports the checkpoint it picked (then fails later on purpose: no data, no server)."""
    ckpt_dir = _checkpoints(tmp_path, [4])
    for step in [4]:
        (ckpt_dir / f"step_{step:08d}" / "manifest.json").unlink()  # none complete: a clear error
    argv = {"serve": ["--model", str(ckpt_dir)], "chat": ["--model", str(ckpt_dir)],
            "eval": ["--model", str(ckpt_dir), "--data", str(tmp_path / "missing.jsonl")]}[command]
    from astrai.cli import main

    assert main([command, *argv]) != 0
    assert f"{ckpt_dir} holds checkpoints but none is complete" in capsys.readouterr().err
