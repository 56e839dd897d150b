"""Loading a checkpoint checks its manifest on the one load path (`manifest.check_model_dir`): file
sizes always, sha256 by default when the files are small enough to hash in about a second
(`AUTO_VERIFY_MAX_BYTES`), `--verify` always, `--no-verify` never; a command's own check and the
load after it hash each file once; `astrai serve` on a damaged model exits with one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from astrai.cli import main as astrai_main
from astrai.model import manifest
from astrai.model.config import ModelConfig
from astrai.model.hf import load_model, save_model
from astrai.model.manifest import ManifestError
from astrai.model.transformer import CausalLM
from astrai.train.publish import publish

CONFIG = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from astrai.data.tokenizer_training import train_tokenizer

    return train_tokenizer(["hello there, how are you today? fine thanks"] * 20, vocab_size=300,
                           out_dir=tmp_path_factory.mktemp("tok"))


@pytest.fixture
def step(tmp_path, tokenizer) -> Path:
    """A published checkpoint (manifest with checksums) of a tiny model."""
    model = CausalLM(ModelConfig(**CONFIG), seed=0)
    return publish(tmp_path / "ckpt", 2, lambda staging: save_model(model, staging, tokenizer))


def _overwrite_tensor_bytes(file: Path) -> None:
    data = bytearray(file.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + 64: header + 128] = b"\x7f" * 64  # 64 bytes inside a tensor; the size stays the same
    file.write_bytes(bytes(data))


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_damaged_weights_fail_to_load_by_default(step):
    _overwrite_tensor_bytes(step / "model.safetensors")
    with pytest.raises(ManifestError, match=r"model\.safetensors fails its sha256 check"):
        load_model(step)
    load_model(step, verify=False)  # the caller's explicit choice: sizes only


def test_above_the_threshold_only_sizes_are_checked_unless_verify(step, monkeypatch):
    monkeypatch.setattr(manifest, "AUTO_VERIFY_MAX_BYTES", 1000)  # the checkpoint is larger than this
    _overwrite_tensor_bytes(step / "model.safetensors")
    load_model(step)  # too large to hash by default: sizes match
    with pytest.raises(ManifestError, match="fails its sha256 check"):
        load_model(step, verify=True)
    (step / "model.safetensors").write_bytes((step / "model.safetensors").read_bytes()[:-8])
    with pytest.raises(ManifestError, match="the file is truncated or altered"):
        load_model(step)  # sizes: always


def test_generate_checks_by_default_and_no_verify_skips(step, capsys):
    _overwrite_tensor_bytes(step / "model.safetensors")
    argv = ["generate", "--model", str(step), "--prompt", "hello", "--max_tokens", "2"]
    assert astrai_main(argv) == 2
    line = _one_line(capsys)
    assert str(step / "model.safetensors") in line and "fails its sha256 check" in line
    assert astrai_main([*argv, "--no-verify"]) == 0  # loaded and answered: the user chose to skip


def test_a_commands_check_and_its_load_hash_each_file_once(step, monkeypatch):
    hashed: list[str] = []
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    assert astrai_main(["generate", "--model", str(step), "--prompt", "hello", "--max_tokens", "2"]) == 0
    listed = sorted(manifest.read_manifest(step)["files"])
    assert sorted(hashed) == listed


@pytest.mark.parametrize("flags", [["--verify"], []])
def test_serve_on_damaged_weights_exits_with_one_line(step, capsys, monkeypatch, flags):
    import astrai.serve.cli

    monkeypatch.setattr(astrai.serve.cli, "create_app", lambda *a, **k: pytest.fail("serve started"))
    _overwrite_tensor_bytes(step / "model.safetensors")
    assert astrai_main(["serve", "--model", str(step), *flags]) == 2
    assert "model.safetensors fails its sha256 check" in _one_line(capsys)


def test_eval_checks_by_default_and_no_verify_skips(step, tmp_path, capsys):
    import json

    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}], "answer": "there"}) + "\n")
    _overwrite_tensor_bytes(step / "model.safetensors")
    argv = ["eval", "--model", str(step), "--data", str(data), "--max_tokens", "2"]
    assert astrai_main(argv) == 2
    line = _one_line(capsys)
    assert str(step / "model.safetensors") in line and "fails its sha256 check" in line
    assert astrai_main([*argv, "--no-verify"]) == 0  # loaded and scored: the user chose to skip
