"""Loading a model directory for serving or generation: manifest sizes always, sha256 with verify,
and a damaged config.json / model.safetensors / tokenizer.json named in one line; `--model` takes a run's
ckpt_dir (its newest complete checkpoint), and a mistyped local path is reported missing, not looked up
as a Hub id."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from astrai.data.tokenizer import load_tokenizer
from astrai.data.tokenizer_training import train_tokenizer
from astrai.infer.generate import main as generate_main
from astrai.model.config import ModelConfig
from astrai.model.hf import load_model, save_model
from astrai.model.hf_config import HFFormatError
from astrai.model.hf_dir import check_device
from astrai.model.manifest import MANIFEST, ManifestError, check_model_dir, resolve_model_dir
from astrai.model.transformer import CausalLM

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world and more words"] * 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    tok = train_tokenizer(TEXTS, vocab_size=300, out_dir=None)
    config = ModelConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    out = tmp_path_factory.mktemp("manifest") / "model"
    save_model(CausalLM(config, seed=0), out, tokenizer=tok)
    return out


def _checkpoint(model_dir: Path, dst: Path) -> Path:
    """A copy of model_dir with a DESIGN.md 3.2 manifest over its files."""
    shutil.copytree(model_dir, dst)
    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(dst.iterdir())}
    (dst / MANIFEST).write_text(json.dumps({"format": "astrai-checkpoint", "version": 1, "step": 3,
                                            "files": files}))
    return dst


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # same size, a weight's last byte: only a checksum sees it
    path.write_bytes(bytes(data))


def _generate(path: Path, *extra: str) -> list[str]:
    return ["--model", str(path), "--prompt", "hi", "--max_tokens", "1", "--kv_cache_tokens", "64", *extra]


def test_sizes_always_checksums_with_verify(model_dir, tmp_path, capsys):
    ckpt = _checkpoint(model_dir, tmp_path / "step_00000003")
    assert check_model_dir(ckpt) and not check_model_dir(model_dir)  # a plain model dir: nothing to check
    load_model(ckpt, verify=True)
    _flip_last_byte(ckpt / "model.safetensors")
    load_model(ckpt, verify=False)  # sizes still match: the cheap check passes
    with pytest.raises(ManifestError, match=r"model\.safetensors fails its sha256 check"):
        load_model(ckpt, verify=True)
    assert generate_main(_generate(ckpt, "--no-verify")) == 0
    capsys.readouterr()
    assert generate_main(_generate(ckpt, "--verify")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.safetensors fails its sha256 check" in err

    weights = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(weights + b"\0")
    with pytest.raises(ManifestError, match=r"model\.safetensors has \d+ bytes, manifest\.json says \d+"):
        load_model(ckpt)
    (ckpt / "model.safetensors").write_bytes(weights)
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(ManifestError, match=r"tokenizer\.json is listed in manifest\.json but missing"):
        check_model_dir(ckpt)
    (ckpt / MANIFEST).write_text("{")
    with pytest.raises(ManifestError, match=r"manifest\.json is not valid JSON"):
        check_model_dir(ckpt)


@pytest.mark.parametrize(("name", "damage", "error"), [
    ("config.json", b'{"vocab_size": 3', HFFormatError),
    ("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{not json", HFFormatError),
    ("tokenizer.json", b'{"version": "1.0", "model": 7}', ValueError),
])
def test_damaged_file_is_named_in_one_line(model_dir, tmp_path, capsys, name, damage, error):
    broken = Path(shutil.copytree(model_dir, tmp_path / "broken"))
    (broken / name).write_bytes(damage)
    with pytest.raises(error, match=rf"{name} is damaged"):
        load_tokenizer(broken) if name == "tokenizer.json" else load_model(broken)
    assert generate_main(_generate(broken)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{broken / name} is damaged" in err


def test_truncated_safetensors_is_named(model_dir, tmp_path):
    broken = Path(shutil.copytree(model_dir, tmp_path / "cut"))
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HFFormatError, match=r"model\.safetensors is damaged"):
        load_model(broken)


def test_unknown_or_unavailable_device(model_dir, capsys):
    import torch

    with pytest.raises(ValueError, match="device 'bogus' is unknown"):
        check_device("bogus")
    assert check_device(None).type == "cpu"
    bad = ["bogus", "cuda:99"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in bad:
        assert generate_main(_generate(model_dir, "--device", device)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"device '{device}'" in err


def test_ckpt_list_verify_marks_a_checksum_damaged_checkpoint(model_dir, tmp_path, capsys):
    from astrai.train.ckpt_cli import main as ckpt_main

    ckpt_dir = tmp_path / "ckpts"
    ckpt_dir.mkdir()
    good = _checkpoint(model_dir, ckpt_dir / "step_00000003")
    bad = _checkpoint(model_dir, ckpt_dir / "step_00000005")
    (bad / MANIFEST).write_text((bad / MANIFEST).read_text().replace('"step": 3', '"step": 5'))
    (good / MANIFEST).write_text((good / MANIFEST).read_text())
    _flip_last_byte(bad / "model.safetensors")
    assert ckpt_main(["list", str(ckpt_dir)]) == 0
    plain = capsys.readouterr().out
    assert "DAMAGED" not in plain and plain.count("complete") >= 2
    assert ckpt_main(["list", str(ckpt_dir), "--verify"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("step_")}
    assert rows["step_00000005"].endswith("DAMAGED (checksum)")
    assert rows["step_00000003"].endswith("complete, verified")


# ---------------------------------------------------------------------------- `--model` takes a run's ckpt_dir

def test_a_mistyped_local_path_is_missing_not_a_hub_id(tmp_path, monkeypatch):
    from astrai.model import hub
    from astrai.model.manifest import model_argument

    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "_offline", lambda: pytest.fail("looked up on the Hub"))
    with pytest.raises(FileNotFoundError, match="'out/ckptt' does not exist: there is a local folder 'out'"):
        model_argument("out/ckptt", "astrai eval")
    assert hub.is_hub_id("org/name")  # a Hub id whose org is no local folder is still one


TINY_CKPT = dict(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=64)


def _checkpoints(tmp_path: Path, steps: list[int]) -> Path:
    from astrai.train.publish import publish

    model = CausalLM(ModelConfig(**TINY_CKPT), seed=0)
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
