"""Damaged LoRA adapters fail as damaged model folders do: one line naming the file, a non-zero exit,
no traceback, in every command that loads one (`generate`, `chat`, `serve`, `lora merge`); an
adapter whose manifest lists checksums is verified like a checkpoint (`ckpt verify`, the default
check at load, `--no-verify` to skip)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from astrai.cli import main as astrai_main
from astrai.model.config import ModelConfig
from astrai.model.hf import load_model, save_model
from astrai.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, apply_lora, save_adapter
from astrai.model.transformer import CausalLM
from astrai.train.publish import publish

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture
def dirs(tmp_path):
    """(base model directory, adapter directory without a manifest)."""
    base = tmp_path / "base"
    save_model(CausalLM(ModelConfig(**CONFIG), seed=0), base)
    model = load_model(base)
    apply_lora(model, r=4, alpha=8, targets=["q", "v"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)
    save_adapter(model, tmp_path / "adapter", str(base))
    return base, tmp_path / "adapter", model


def _truncate(adapter: Path) -> Path:
    file = adapter / ADAPTER_WEIGHTS
    file.write_bytes(file.read_bytes()[:-100])
    return file


def _corrupt_header(adapter: Path) -> Path:
    file = adapter / ADAPTER_WEIGHTS
    data = bytearray(file.read_bytes())
    data[8:24] = b"\x00garbage!\xff\xfe{{{{}"  # the JSON header, right after its 8-byte length
    file.write_bytes(bytes(data))
    return file


def _edit_config(adapter: Path, edit) -> Path:
    file = adapter / ADAPTER_CONFIG
    config = json.loads(file.read_text())
    text = edit(config)
    file.write_text(text if isinstance(text, str) else json.dumps(config))
    return file


DAMAGE = {
    "truncated": _truncate,
    "corrupt_header": _corrupt_header,
    "missing_r": lambda a: _edit_config(a, lambda c: c.pop("r") and None),
    "invalid_json": lambda a: _edit_config(a, lambda c: '{"r": 4, "target_modules": ["q_proj"'),
    "r_not_int": lambda a: _edit_config(a, lambda c: c.update(r="four")),
}


def _commands(base: Path, adapter: Path, out: Path) -> dict[str, list[str]]:
    return {
        "generate": ["generate", "--model", str(base), "--lora", str(adapter), "--prompt", "hi"],
        "chat": ["chat", "--model", str(base), "--lora", str(adapter)],
        "serve": ["serve", "--model", str(base), "--lora", str(adapter), "--port", "0"],
        "lora merge": ["lora", "merge", "--adapter", str(adapter), "--base", str(base), "--out", str(out)],
    }


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("command", ["generate", "chat", "serve", "lora merge"])
def test_damaged_adapter_is_one_line_naming_the_file(dirs, tmp_path, capsys, monkeypatch, damage, command):
    import astrai.serve.cli

    monkeypatch.setattr(astrai.serve.cli, "create_app", lambda *a, **k: pytest.fail("serve started"))
    base, adapter, _ = dirs
    file = DAMAGE[damage](adapter)
    code = astrai_main(_commands(base, adapter, tmp_path / "merged")[command])
    line = _one_line(capsys)
    assert code != 0
    assert str(file) in line, line
    assert not (tmp_path / "merged").exists()


def _published_adapter(model, base: Path, ckpt_dir: Path) -> Path:
    """The adapter as a LoRA run publishes it: a step directory with a manifest of checksums."""
    return publish(ckpt_dir, 3, lambda staging: save_adapter(model, staging, str(base)))


def _flip_tensor_bytes(file: Path) -> None:
    data = bytearray(file.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + 16: header + 80] = bytes(64)  # 64 bytes inside a tensor; the size stays the same
    file.write_bytes(bytes(data))


def test_adapter_checksums_are_checked_by_default_and_by_ckpt_verify(dirs, tmp_path, capsys):
    base, _, model = dirs
    step = _published_adapter(model, base, tmp_path / "ckpt")
    assert astrai_main(["ckpt", "verify", str(step)]) == 0
    _flip_tensor_bytes(step / ADAPTER_WEIGHTS)
    capsys.readouterr()

    assert astrai_main(["ckpt", "verify", str(step)]) == 1
    assert f"{step / ADAPTER_WEIGHTS} fails its sha256 check" in capsys.readouterr().out
    # loading: the default check hashes a small adapter; --no-verify skips that (sizes still match)
    argv = ["lora", "merge", "--adapter", str(step), "--base", str(base), "--out", str(tmp_path / "m")]
    assert astrai_main(argv) != 0
    assert "fails its sha256 check" in _one_line(capsys)
    with pytest.raises(ValueError, match="fails its sha256 check"):
        load_model(base, lora=step)
    load_model(base, lora=step, verify=False)  # the caller's choice: the bytes are not hashed


def test_serve_verify_lora_checks_adapter_checksums_before_starting(dirs, tmp_path, capsys, monkeypatch):
    import astrai.serve.cli

    monkeypatch.setattr(astrai.serve.cli, "create_app", lambda *a, **k: pytest.fail("serve started"))
    base, _, model = dirs
    step = _published_adapter(model, base, tmp_path / "ckpt")
    _flip_tensor_bytes(step / ADAPTER_WEIGHTS)
    assert astrai_main(["serve", "--model", str(base), "--lora", str(step), "--verify"]) == 2
    assert "fails its sha256 check" in _one_line(capsys)
