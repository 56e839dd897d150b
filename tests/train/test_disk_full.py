"""A full disk during a checkpoint: one line naming the directory, the bytes the checkpoint needs and
the bytes free; the run exits non-zero; the last good checkpoint stays intact and the newest; no
staging directory is left behind. The write is made to fail with ENOSPC by monkeypatching."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
import yaml

from astrai.train import signals
from astrai.train.cli import main
from astrai.train.publish import CheckpointError, latest_checkpoint, publish, verify_checkpoint


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    yield
    signals.uninstall_signal_handlers()


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_publish_on_a_full_disk_is_one_error_and_leaves_no_staging(tmp_path):
    good = publish(tmp_path, 1, lambda d: (d / "weights.bin").write_bytes(b"x" * 5000))

    def write(staging: Path) -> None:
        (staging / "weights.bin").write_bytes(b"y" * 1000)  # part of it lands, then the disk is full
        _enospc()

    with pytest.raises(CheckpointError) as info:
        publish(tmp_path, 2, write)
    message = str(info.value)
    assert "\n" not in message and info.value.__cause__ is None and info.value.__suppress_context__
    assert message.startswith(f"no space left in {tmp_path}: the checkpoint needs ")
    needed = int(message.split("needs ")[1].split(" bytes")[0].replace(",", ""))
    assert needed >= 5000  # as large as the last checkpoint
    assert "free; free space or set --ckpt_dir" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    verify_checkpoint(good)


def test_a_wrapped_enospc_counts_and_other_errors_pass_through(tmp_path):
    def wrapped(staging: Path) -> None:  # torch.save and safetensors raise their own types
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: No space left on device")

    with pytest.raises(CheckpointError, match="no space left in"):
        publish(tmp_path, 1, wrapped)
    with pytest.raises(PermissionError):
        publish(tmp_path, 1, lambda staging: (_ for _ in ()).throw(PermissionError(errno.EACCES, "denied")))


def _config(tmp_path: Path) -> Path:
    from astrai.data.tokenizer_training import train_tokenizer

    rows = [{"text": f"the number {i} follows {i - 1} and comes before {i + 1}"} for i in range(16)]
    (tmp_path / "seq.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_tokenizer([tmp_path / "seq.jsonl"], vocab_size=300, out_dir=tmp_path / "tok")
    cfg = {
        "model": {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "max_position_embeddings": 64},
        "data": {"train_type": "seq", "data_path": str(tmp_path / "seq.jsonl"), "tokenizer_path": str(tmp_path / "tok"),
                 "max_seq_len": 32},
        "train": {"batch_per_device": 4, "max_steps": 3},
        "ckpt": {"ckpt_dir": str(tmp_path / "ckpt"), "ckpt_interval": 1, "keep_last": 3, "ckpt_background": False},
        "log": {"log_dir": str(tmp_path / "log"), "progress": False},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "run.yaml"


def test_a_run_whose_disk_fills_exits_nonzero_in_one_line_with_the_last_checkpoint_intact(tmp_path, capsys,
                                                                                           monkeypatch):
    path = _config(tmp_path)
    real_save = torch.save
    calls = {"n": 0}

    def save(obj, f, *args, **kwargs):  # the disk fills during the second checkpoint's optimizer.pt
        if str(f).endswith("optimizer.pt"):
            calls["n"] += 1
            if calls["n"] == 2:
                _enospc()
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    assert main(["--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    problem = [line for line in err.splitlines() if "no space left" in line]
    assert len(problem) == 1 and problem[0].startswith(f"astrai train: error: no space left in {tmp_path / 'ckpt'}")
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if p.name != ".lock") == ["step_00000001"]
    verify_checkpoint(ckpt / "step_00000001")
    assert latest_checkpoint(ckpt) == ckpt / "step_00000001"
